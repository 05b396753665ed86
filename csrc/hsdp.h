/* hsdp.h - the C core's own API. No Python in here: the wrapper in py/ is the only code that
 * knows about CPython. Every function that can fail returns an hsdp_status and leaves a message
 * that hsdp_last_error() returns (thread-local, so the MPI worker thread cannot clobber the
 * caller's message). Library code never exits or aborts. */
#ifndef HSDP_H
#define HSDP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors */
typedef enum {
    HSDP_OK = 0,
    HSDP_EINVAL,      /* a bad argument: maps to ValueError */
    HSDP_ETYPE,       /* a bad dtype or kind: maps to TypeError */
    HSDP_ENOMEM,      /* allocation failed: maps to MemoryError */
    HSDP_EIO,         /* file I/O: maps to OSError */
    HSDP_ECOMM,       /* a collective failed: maps to RuntimeError */
    HSDP_ESTATE,      /* wrong lifecycle state: maps to RuntimeError */
    HSDP_EUNSUPPORTED, /* not compiled in / not built yet: maps to NotImplementedError */
    HSDP_ENODEVICE     /* built, but the device it needs is not there (no GPU): maps to
                        * RuntimeError, as torch raises for a missing GPU */
} hsdp_status;

const char *hsdp_last_error(void);
/* Records a printf-style message and returns `st`, so callers can `return hsdp_fail(...)`. */
hsdp_status hsdp_fail(hsdp_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* ---------------------------------------------------------------- dtypes (dtype.c) */
typedef enum {
    HSDP_F32 = 0,
    HSDP_F16,
    HSDP_BF16,
    HSDP_F8E4M3, /* float8_e4m3fn: no infinities, one NaN pattern per sign, max 448 */
    HSDP_F8E5M2, /* float8_e5m2: IEEE-like, max 57344 */
    HSDP_F64,
    HSDP_BOOL,
    HSDP_U8,
    HSDP_I8,
    HSDP_U16,
    HSDP_I16,
    HSDP_U32,
    HSDP_I32,
    HSDP_U64,
    HSDP_I64,
    HSDP_DTYPE_COUNT
} hsdp_dtype;

size_t hsdp_dtype_size(hsdp_dtype dt);
/* Canonical names: "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
 * "float64", "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64",
 * "int64". NULL for an out-of-range value. */
const char *hsdp_dtype_name(hsdp_dtype dt);
/* Exact canonical name -> dtype. Returns 0 on success, -1 if unknown (no error recorded). */
int hsdp_dtype_from_name(const char *name, hsdp_dtype *out);
int hsdp_dtype_is_float(hsdp_dtype dt);

/* Scalar conversions. float -> narrow rounds to nearest, ties to even. NaN stays NaN;
 * overflow gives infinity for f16/bf16/e5m2 and NaN for e4m3fn (it has no infinity). */
uint16_t hsdp_f32_to_bf16(float f);
float hsdp_bf16_to_f32(uint16_t h);
uint16_t hsdp_f32_to_f16(float f);
float hsdp_f16_to_f32(uint16_t h);
uint8_t hsdp_f32_to_f8e4m3(float f);
float hsdp_f8e4m3_to_f32(uint8_t b);
uint8_t hsdp_f32_to_f8e5m2(float f);
float hsdp_f8e5m2_to_f32(uint8_t b);

/* Block-scaled float8 e4m3fn, the wire format of a unit with a wire dtype (unit.c). n
 * elements go in blocks of HSDP_WIRE_BLOCK consecutive elements (the last one shorter), one
 * float32 scale per block: scale = absmax / 448 over the block's finite values (rounded once
 * to float32), q = e4m3(x / scale) rounded to nearest even and saturated at +-448, so a
 * finite weight never becomes NaN. A block whose scale is 0 (all zeros, or absmax below
 * 448 * 2^-150) stores +-0. NaN stays NaN and +-inf becomes NaN (e4m3fn has no infinity,
 * as torch's own cast); neither takes part in the scale. Dequantizing is e4m3(q) * scale in
 * float32, rounded once to the destination dtype. src/dst: float32, float16 or bfloat16;
 * scales holds ceil(n / HSDP_WIRE_BLOCK) floats (need not be aligned). */
#define HSDP_WIRE_BLOCK 128
#define HSDP_F8E4M3_MAX 448.0f
hsdp_status hsdp_quantize_blocks(uint8_t *q, float *scales, const void *src, hsdp_dtype st, size_t n);
hsdp_status hsdp_dequantize_blocks(void *dst, hsdp_dtype dt, const uint8_t *q, const float *scales, size_t n);
/* The same bytes with streaming (non-temporal) stores where the decode has them (the AVX512
 * one, dtype.c): for a destination larger than the caches, whose next reader would miss them
 * anyway; the stores are fenced before it returns. */
hsdp_status hsdp_dequantize_blocks_streaming(void *dst, hsdp_dtype dt, const uint8_t *q, const float *scales,
                                             size_t n);

/* Casts n elements from src (dtype st) to dst (dtype dt). Same dtype: a copy. Between
 * floating dtypes: a conversion (through double when either side is f64, else float).
 * Anything else (int <-> float, int <-> other int) is HSDP_ETYPE. dst and src must not
 * overlap unless dt == st and dst == src. */
hsdp_status hsdp_cast(void *dst, hsdp_dtype dt, const void *src, hsdp_dtype st, size_t n);

/* ---------------------------------------------------------------- memory accounting */
/* Bytes this process holds for hsdp, kept by the core itself. Counters are atomic so the
 * MPI worker thread and the Python thread can both update them. */
typedef struct {
    _Atomic size_t sharded_bytes;       /* sum of the host shard chunks of live units (a chunk
                                           dropped once on the GPU is not counted) */
    _Atomic size_t unsharded_bytes;     /* live gather/widen buffers */
    _Atomic size_t peak_unsharded_bytes;
    _Atomic size_t whole_bytes;         /* ignored / unshardable parameters kept whole */
    _Atomic size_t pooled_bytes;        /* idle unsharded buffers kept for reuse */
    _Atomic uint64_t buffer_allocs;     /* unsharded buffers allocated so far */
    _Atomic uint64_t gathers;           /* unit gathers issued so far */
} hsdp_stats;

void hsdp_stats_init(hsdp_stats *st);

/* Where an unsharded buffer lives: host memory, which needs nothing from a backend, or the
 * device of the backend that allocates it (its device table, device.h, says which). */
typedef enum { HSDP_DEVICE_HOST = 0, HSDP_DEVICE_BACKEND = 1 } hsdp_device;

/* memory.c: aligned (64 bytes) host memory, accounted as unsharded. Returns NULL (and
 * records an error) on failure. The caller owns the result and gives it back with
 * hsdp_buffer_free. */
void *hsdp_buffer_alloc(hsdp_stats *st, size_t nbytes);
void hsdp_buffer_free(hsdp_stats *st, void *p, size_t nbytes);
/* Returns freed heap memory to the system where the C library keeps it (glibc's
 * malloc_trim); 1 if it released any. Called after sharding, when the full weights are gone. */
int hsdp_trim_memory(void);
/* The accounting alone, for allocators of other devices and for pools: nbytes become
 * unsharded (the peak follows); an allocation is counted; nbytes stop being unsharded. */
void hsdp_stats_note_unsharded(hsdp_stats *st, size_t nbytes);
void hsdp_stats_count_alloc(hsdp_stats *st, size_t nbytes);
void hsdp_stats_count_free(hsdp_stats *st, size_t nbytes);

/* ---------------------------------------------------------------- mesh (mesh.c) */
/* World ranks laid row-major over (replicate, shard): rank = r * shard + s. */
typedef struct {
    int world_size, rank;
    int replicate, shard; /* sizes */
    int r, s;             /* this rank's coordinates */
} hsdp_mesh;

/* The sizes alone, before a world size is known: replicate > 0, shard > 0 or -1 (auto). The
 * one place these rules live (the config type and the mesh both call it). */
hsdp_status hsdp_mesh_check_sizes(int replicate, int shard);
/* shard == -1 means auto: world_size / replicate. Validates everything against the world. */
hsdp_status hsdp_mesh_init(hsdp_mesh *m, int world_size, int rank, int replicate, int shard);
int hsdp_mesh_rank_of(const hsdp_mesh *m, int r, int s);
/* Fills ranks[0..shard) with this rank's shard group (same r), ascending. */
void hsdp_mesh_shard_group(const hsdp_mesh *m, int *ranks);
/* Fills ranks[0..replicate) with this rank's replicate group (same s), ascending. */
void hsdp_mesh_replicate_group(const hsdp_mesh *m, int *ranks);

/* ---------------------------------------------------------------- layout (layout.c) */
#define HSDP_ALIGN 64
/* Where a parameter of 256 bytes or more starts in the unsharded buffer: a multiple of 256
 * bytes, the largest alignment cuBLASLt tells apart (its MIN_ALIGNMENT_* attributes), so a
 * view into a gathered buffer is given the same kernels as a tensor of its own (torch's
 * allocator hands out 512-byte aligned blocks); a bit-exact parity with the unsharded model
 * depends on it on GPUs. A smaller one (a norm's weight, a small bias) starts at the largest
 * power of two not above its size, at least HSDP_ALIGN: no matrix is that small, and a small
 * model's units are not half padding (hsdp_slot_align). */
#define HSDP_SLOT_ALIGN 256
size_t hsdp_slot_align(size_t nbytes);

typedef struct {
    size_t offset; /* byte offset in the unsharded buffer, a multiple of hsdp_slot_align(nbytes) */
    size_t nbytes; /* numel * itemsize */
    size_t numel;
    hsdp_dtype dtype; /* storage dtype */
} hsdp_slot;

typedef struct {
    size_t nslots;
    hsdp_slot *slots;   /* owned by the layout */
    size_t used_bytes;  /* end of the last parameter */
    size_t total_bytes; /* used_bytes padded to a multiple of HSDP_ALIGN * shard */
    size_t chunk_bytes; /* total_bytes / shard: what each rank of the shard group holds */
    int shard;
} hsdp_layout;

hsdp_status hsdp_layout_init(hsdp_layout *l, const size_t *numels, const hsdp_dtype *dtypes,
                             size_t n, int shard);
void hsdp_layout_free(hsdp_layout *l);
/* The part of slot i that rank s owns, as a byte range [*begin, *end) within the parameter
 * (element-aligned, since chunks are multiples of HSDP_ALIGN). Returns 0 when rank s owns
 * none of it. *chunk_off receives where that range starts inside rank s's chunk. */
int hsdp_layout_owned(const hsdp_layout *l, size_t i, int s, size_t *begin, size_t *end,
                      size_t *chunk_off);

/* ---------------------------------------------------------------- collectives (backend.h) */
typedef struct hsdp_group hsdp_group;

/* One collective in flight (backend.c): owned by the caller and embedded where it is used, so
 * starting a gather allocates nothing. `then` is host work the backend runs once the
 * collective is done, on its own completion context (the MPI worker thread; the caller's
 * thread for a backend without asynchronous slots). */
#define HSDP_REQ_STATE_BYTES 768
typedef struct hsdp_req {
    hsdp_group *g;
    hsdp_status (*then)(void *arg);
    void *then_arg;
    void **share;                         /* a fixed chunk's share (hsdp_gather_fixed), or NULL */
    const char *label;                    /* borrowed: what is gathered, for timeout messages */
    uint64_t ident;                       /* the unit's identity (hsdp_unit.ident), when share is set */
    int pending;                          /* started, not yet waited */
    int backend_owned;                    /* started through the backend's gather_start */
    int now;                              /* waited at once (hsdp_gather_through_slot): it may run on this thread */
    hsdp_status status;                   /* of the collective and `then`, set when done */
    char err[512];                        /* its message, re-raised on the waiting thread */
    uint64_t submit_ns, start_ns, end_ns; /* CLOCK_MONOTONIC, for traces */
    /* the backend's own state for this request (MPI: its worker task) */
    _Alignas(16) unsigned char state[HSDP_REQ_STATE_BYTES];
} hsdp_req;

/* CLOCK_MONOTONIC in ns: the clock of request times and traces (backend.c). */
uint64_t hsdp_now_ns(void);

/* ---------------------------------------------------------------- units (unit.c) */
typedef struct {
    hsdp_layout layout;
    hsdp_group *group;      /* borrowed: the shard group */
    hsdp_stats *stats;      /* borrowed */
    int s;                  /* this rank's index in the shard group */
    unsigned char *shard;   /* owned: layout.chunk_bytes, in storage dtypes */
    hsdp_dtype *compute;    /* owned: per slot, the dtype its unsharded view is computed in */
    size_t *widen_offset;   /* owned: per slot, offset in the converted buffer or SIZE_MAX */
    size_t widened_bytes;   /* size of the converted buffer (0 when every slot computes in its
                             * storage dtype) */
    void *share;            /* owned (hsdp_share_free): set by the first gather; from then on
                             * the shard is fixed, since peers may read it directly */
    char label[64];         /* the unit's name, for messages (set by the caller; may be empty) */
    uint64_t ident;         /* which unit of its group, counted as made (group->units_made):
                             * the same on every rank, checked by the gathers that agree */
    /* The wire encoding (hsdp_unit_set_wire), NULL/0 without one. */
    unsigned char *quant;    /* owned: per slot, 1 when it travels as block-scaled float8 */
    size_t wire_chunk_bytes; /* each rank's encoded chunk, the same on every rank */
    size_t *wire_blocks;     /* owned: per rank of the shard group, the float32 scales that open
                              * its encoded chunk (counted once, by hsdp_unit_set_wire) */
    int wire_encoded;        /* the shard holds the encoding: fixed from then on */
} hsdp_unit;

/* Sets up the layout and a zeroed shard. compute[i] is the dtype slot i is computed in, as
 * the caller's framework needs it (NumPy: float32 for bfloat16 and float8; torch: the
 * storage dtype); NULL means every slot computes in its storage dtype. A slot whose compute
 * dtype differs is converted from the gathered buffer into a second buffer while
 * unsharding. The unit borrows group and stats; both must outlive it. */
hsdp_status hsdp_unit_init(hsdp_unit *u, const size_t *numels, const hsdp_dtype *dtypes,
                           const hsdp_dtype *compute, size_t n, hsdp_group *group, hsdp_stats *stats);
void hsdp_unit_free(hsdp_unit *u);
/* Writes elements [first, first + count) of slot i from src (dtype src_dt), keeping only the
 * part that falls in this rank's chunk, cast to the slot's storage dtype. A full parameter is
 * first = 0, count = numel. */
hsdp_status hsdp_unit_write(hsdp_unit *u, size_t i, size_t first, size_t count, const void *src,
                            hsdp_dtype src_dt);
/* Makes the unit travel block-scaled: the slots with quant[i] set (float32, float16 or
 * bfloat16 storage) are sent as float8 (wire must be HSDP_F8E4M3) with one float32 scale per
 * HSDP_WIRE_BLOCK elements, the others as they are stored. Before any gather; nothing
 * changes when no slot is marked. Each rank's chunk is encoded alone (blocks start at the
 * start of each parameter's piece of the chunk and never span two parameters), by
 * hsdp_unit_encode or else by the first gather; from then on the shard is the encoding
 * (layout.chunk_bytes of storage dtypes become wire_chunk_bytes) and it is fixed. Every
 * gather dequantizes into the storage dtypes of `full` right after the collective. */
hsdp_status hsdp_unit_set_wire(hsdp_unit *u, hsdp_dtype wire, const unsigned char *quant);
hsdp_status hsdp_unit_encode(hsdp_unit *u);
/* Bytes of the shard as held now (the encoding's once encoded). */
size_t hsdp_unit_shard_bytes(const hsdp_unit *u);
/* Decodes the gathered encodings (shard * wire_chunk_bytes) into `full` (layout.total_bytes,
 * storage dtypes; padding zeroed). */
hsdp_status hsdp_unit_decode(const hsdp_unit *u, const void *wire, void *full);
/* HSDP_ESTATE once the unit has been gathered: from then on its shard is fixed (peers may
 * read it directly), so write, read and broadcast into it are refused. */
hsdp_status hsdp_unit_check_writable(const hsdp_unit *u);
/* All-gathers every rank's chunk into `full` (layout.total_bytes), on this thread, decoding a
 * wire encoding on the host after the whole gather, converting nothing. On a backend that keeps
 * its own copy of the chunk (NCCL: on the device, after the first gather) the host chunk is
 * then freed (u->shard NULL), unless HSDP_KEEP_HOST_SHARDS=1; the same after the first
 * gather_start or gather_now. */
hsdp_status hsdp_unit_gather(hsdp_unit *u, void *full);
/* This rank's chunk (layout.chunk_bytes) into host memory `out`: the host chunk, or, once
 * dropped, read back from the backend's copy. */
hsdp_status hsdp_unit_read_shard(hsdp_unit *u, void *out);

/* A unit's gather in flight: the collective request plus what the conversion needs. */
typedef struct {
    hsdp_req req;
    hsdp_unit *u;
    void *full;
    void *widened;  /* where the conversion writes; NULL when nothing converts */
    void *wire;     /* the gathered encodings while in flight (hsdp_unit_wire_bytes) */
    int wire_owned; /* wire was allocated by the request: the wait frees it */
    int decoded;    /* chunks the backend decoded as they landed (hsdp_unit_decode_landed) */
    int widened_landed; /* the backend widened every chunk as it read it (hsdp_unit_widen_piece) */
} hsdp_gather_req;
/* Asynchronous gather + conversion through the backend's asynchronous slots (with none, it
 * runs on the caller's thread before returning). req is owned by the caller and must stay
 * alive until hsdp_unit_gather_wait returns; one request per unit at a time. */
hsdp_status hsdp_unit_gather_start(hsdp_unit *u, void *full, void *widened, hsdp_gather_req *req);
hsdp_status hsdp_unit_gather_wait(hsdp_unit *u, hsdp_gather_req *req);
/* The same, receiving a unit with a wire encoding into `wire` (hsdp_unit_wire_bytes, the
 * caller's, alive until the wait returns; a pooled buffer, say) rather than into a buffer
 * the request allocates and frees. wire is ignored without an encoding. */
hsdp_status hsdp_unit_gather_start_wire(hsdp_unit *u, void *full, void *widened, void *wire, hsdp_gather_req *req);
hsdp_status hsdp_unit_gather_now_wire(hsdp_unit *u, void *full, void *widened, void *wire, hsdp_gather_req *req);
/* The wire gather behind r (a unit's, whose `then` decodes), else NULL. A backend whose
 * buffers are on a device may run that decode itself when it is the only conversion
 * (widened NULL). A host backend may decode rank s's encoded chunk (wire_chunk_bytes at
 * `chunk`: where it landed, or this rank's send buffer) into the gather's `full` as soon as
 * it is there, with
 * hsdp_unit_decode_landed, calling poll(poll_arg) between slices of the work (to keep its
 * other transfers moving; poll may be NULL). Once every rank's chunk has been decoded so, the
 * gather's `then` does not decode again; the backend decodes only what its gather agreed on. */
hsdp_gather_req *hsdp_unit_landing_request(hsdp_req *r);
hsdp_status hsdp_unit_decode_landed(hsdp_gather_req *r, int s, const void *chunk, void (*poll)(void *),
                                    void *poll_arg);
/* One piece of rank s's encoded chunk: slot `slot`'s part of the rank's chunk, at `off` in
 * it, `bytes` long (`n` elements); in the encoding, `pay` bytes into the payload (which
 * follows the scales) and, when `quant`, n float8 bytes whose first scale is number `block`
 * (the others: their stored bytes). */
typedef struct {
    size_t slot, off, bytes, n, block, pay;
    int quant, started;
} hsdp_wire_piece;
/* The walk every reader and writer of the encoding takes: with *p zeroed, each call moves to
 * the next piece of rank s's chunk in layout order and returns 1, or 0 once none is left; then
 * p->block and p->pay are the whole chunk's blocks and payload bytes. */
int hsdp_wire_next(const hsdp_unit *u, int s, hsdp_wire_piece *p);
/* Where the decode of one rank's chunk stands, for one that lands in pieces: zeroed before the
 * first call; done once the whole chunk is decoded. */
typedef struct {
    hsdp_wire_piece p; /* the piece being decoded, when `have` */
    size_t k, at;      /* how far into it (weights, or bytes); bytes of the rank's chunk written */
    int have, done;
} hsdp_wire_cursor;
/* The same as hsdp_unit_decode_landed for a chunk whose first `landed` bytes are in: decodes
 * what they allow, from where *c stands (nothing before all the scales are in; a quantized
 * parameter up to its last whole block in). The chunk counts as decoded once *c is done. The
 * bytes written are the same however the chunk lands. */
hsdp_status hsdp_unit_decode_prefix(hsdp_gather_req *r, int s, const void *chunk, size_t landed, hsdp_wire_cursor *c,
                                    void (*poll)(void *), void *poll_arg);
/* The gather behind r when its one conversion is a widening (a unit's, with `widened` and no
 * wire), else NULL. A host backend that reads each rank's chunk itself (MPI's direct gathers)
 * may then, instead of receiving into `full`, pass every byte of every chunk, in pieces, to
 * hsdp_unit_widen_piece: bytes [at, at + n) of rank s's chunk at `src`, the converted slots'
 * parts widened into `widened`, every other byte copied into `full` (so `full`'s bytes of the
 * converted slots are left unwritten: no view reads them). at and n must be multiples of 64
 * (n may end at the chunk's end). Once it has passed them all it sets widened_landed, and the
 * gather's `then` converts nothing. */
hsdp_gather_req *hsdp_unit_widen_request(hsdp_req *r);
hsdp_status hsdp_unit_widen_piece(hsdp_gather_req *r, int s, size_t at, const void *src, size_t n);
/* Bytes of the buffer a gather receives the encodings in (0 without a wire encoding). */
size_t hsdp_unit_wire_bytes(const hsdp_unit *u);
/* Synchronous gather + conversion through the same request (so traces see its times). */
hsdp_status hsdp_unit_gather_now(hsdp_unit *u, void *full, void *widened, hsdp_gather_req *req);
/* Converts the slots whose compute dtype differs from their storage dtype from `full` into
 * `widened` (widened_bytes). */
hsdp_status hsdp_unit_widen(const hsdp_unit *u, const void *full, void *widened);

/* ---------------------------------------------------------------- checkpoint data path (checkpoint.c) */
/* Reads slot i's elements that fall in this rank's chunk from an open file: the tensor is
 * stored contiguously at byte `tensor_off` in dtype src_dt (numel elements). Reads exactly
 * those bytes with pread (no full tensor is ever materialised) and casts them to the storage
 * dtype on the way in, through a bounded bounce buffer when the dtypes differ. *nread gets
 * the number of file bytes read. */
hsdp_status hsdp_unit_read(hsdp_unit *u, size_t i, int fd, uint64_t tensor_off, hsdp_dtype src_dt,
                           size_t *nread);
/* pread of exactly n bytes at off into dst (retrying short reads and EINTR). */
hsdp_status hsdp_pread_exact(int fd, void *dst, size_t n, uint64_t off);

#ifdef __cplusplus
}
#endif
#endif
