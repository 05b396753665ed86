/* device.h - the device interface: where a backend's unsharded buffers live when that is not
 * host memory, and how a consumer of them is ordered after the collectives writing them.
 * Kept apart from the collectives as ggml keeps device_i apart from its backend: a backend
 * table points at one const hsdp_device_i, or at none (NULL: host memory only; single, MPI).
 * Nothing outside a backend's own file knows which device it is: the buffer pool, DLPack, the
 * group type and Python ask the table (docs/design.md, [Note: the device contract]).
 *
 * Required slots: name, framework, dlpack_type, alloc, free.
 * Optional slots (NULL when absent):
 *   dlpack_id        the device id exported over DLPack (0 when absent)
 *   released         buffers of this device went back to the pool: work the caller's compute
 *                    stream was given so far may still read them, so later collectives writing
 *                    into them must wait for it first (NCCL: an event on the compute stream)
 *   consumer_wait    a DLPack consumer's stream waits for every collective in flight writing
 *                    into a buffer (honours __dlpack__(stream=)); absent: the device has no
 *                    streams, and a buffer's bytes have landed when its gather's wait returns
 *   call_stream      until cleared, the collectives this thread makes on device addresses
 *                    order on the caller's stream (absent: they run in program order)
 *   live_bytes       the bytes of its buffers alive now, by its own count (tests compare it
 *                    with the pool's)
 *   wire_missing     the float8 wire's decode into its buffers: NULL when it can run now, else
 *                    a static sentence saying what is missing (NCCL: the kernel, loaded by
 *                    hsdp.nccl.load_wire_kernel). Absent: the wire is not built for the device
 *   mem_free         the bytes free on the device now, for this process (NCCL: cudaMemGetInfo
 *                    on its GPU, what torch.cuda.mem_get_info asks). Absent: the device's
 *                    memory is the host's, and callers read the host's (MemAvailable)
 *   reader_after     how the owning backend orders the reader of one of its collectives'
 *                    output after it: a stream waits (CUDA), or, on a device without streams
 *                    whose memory the host reads, the host blocks. Only that backend calls
 *                    it, through hsdp_backend_device, so that its collective paths never
 *                    ask which device they run on (NCCL over the test fake: a second table) */
#ifndef HSDP_DEVICE_H
#define HSDP_DEVICE_H

#include "hsdp.h"

typedef struct hsdp_backend hsdp_backend;

typedef struct hsdp_device_i {
    /* The device's name as users and _Buffer.device see it, and as Unit(device=) and
     * pool_reserve take it ("cuda"); unique among the registered backends. */
    const char *name;
    /* The framework device type a view of its buffers has ("cuda"; a device whose memory the
     * host reads, such as the test-only fakedev, says "cpu"). */
    const char *framework;
    /* The DLPack device type its buffers are exported as (kDLCPU = 1, kDLCUDA = 2). */
    int dlpack_type;
    int (*dlpack_id)(void);
    /* An unsharded buffer of nbytes (>= 1), owned by the caller until free; NULL when the
     * device is not ready or out of memory (the caller records the error). */
    void *(*alloc)(size_t nbytes);
    void (*free)(void *p, size_t nbytes);
    void (*released)(void);
    /* Orders a DLPack consumer after the writes into [p, p + n). stream is the consumer's
     * __dlpack__(stream=) value, given == 0 when it passed None: the device interprets it
     * (its DLPack stream conventions) and refuses a value it does not take. The host never
     * blocks. */
    hsdp_status (*consumer_wait)(int given, long long stream, const void *p, size_t n);
    /* set = 1: collectives on device addresses from this thread order on `stream` (a handle
     * of the caller's) until called again with set = 0. */
    void (*call_stream)(void *stream, int set);
    size_t (*live_bytes)(void);
    const char *(*wire_missing)(void);
    /* done: the backend's mark of a collective's end (NCCL: its CUDA event); stream: the
     * reader's (NULL: the legacy default stream); what: the collective, for messages. A
     * stream is made to wait and this returns at once; without streams the host waits until
     * done, within the timeout (HSDP_TIMEOUT), and the bytes have landed when it returns. */
    hsdp_status (*reader_after)(void *done, void *stream, const char *what);
    /* *free_bytes: free device memory now; an error (recorded) when it cannot be read. */
    hsdp_status (*mem_free)(size_t *free_bytes);
} hsdp_device_i;

/* The device of b's buffers, or NULL when b has host memory only (or b is NULL). */
const hsdp_device_i *hsdp_backend_device(const hsdp_backend *b);
/* The registered backend whose device is named `name`, or NULL. */
const hsdp_backend *hsdp_device_backend(const char *name);
/* A device name as Unit(device=) and pool_reserve take it: "host", or a registered backend's
 * device name. 0 with *out (and *label, a static string, when non-NULL) set; -1 when unknown
 * (no error recorded). */
int hsdp_device_parse(const char *name, hsdp_device *out, const char **label);
/* "'host', 'cuda', ..." (every name hsdp_device_parse takes), into buf. */
const char *hsdp_device_choices(char *buf, size_t size);
/* What users see for a buffer of `device` allocated by b: "host", or b's device name. */
const char *hsdp_device_label(const hsdp_backend *b, hsdp_device device);

/* An accounted unsharded buffer on `device`: host memory from hsdp_buffer_alloc, the
 * backend's device from its device table (HSDP_EUNSUPPORTED when it has none). The caller
 * owns it and gives it back with hsdp_device_free. */
void *hsdp_device_alloc(hsdp_stats *st, const hsdp_backend *b, hsdp_device device, size_t nbytes);
void hsdp_device_free(hsdp_stats *st, const hsdp_backend *b, hsdp_device device, void *p, size_t nbytes);
/* Tells the backend's device that buffers of `device` went back to the pool (see released). */
void hsdp_buffers_released(const hsdp_backend *b, hsdp_device device);

#endif
