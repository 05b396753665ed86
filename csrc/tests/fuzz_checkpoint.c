/* fuzz_checkpoint.c - libFuzzer harness (ASan + UBSan) over the checkpoint data path:
 * hsdp_unit_read on a file built from the fuzz input, with a unit layout derived from it.
 *
 * Input: [shard size][rank][slot count] then per slot [numel lo][numel hi][storage dtype]
 * [source dtype][offset lo][offset hi][offset flags], then the file's bytes. The oracle is
 * independent of the read path: the call succeeds exactly when the dtypes are compatible and
 * the rank's byte range lies inside the file, and then the rank's chunk holds hsdp_cast of
 * exactly those file bytes (untouched bytes stay zero).
 *
 * Built by `make fuzz-build` with -DHSDP_BOUNCE_BYTES=64, so the bounce-buffer loop of a
 * casting read runs many rounds on small inputs. */
#define _GNU_SOURCE /* memfd_create */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend.h"
#include "hsdp.h"

static hsdp_status no_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    (void)g, (void)send, (void)recv, (void)nbytes;
    return hsdp_fail(HSDP_ECOMM, "fuzz group: no collectives");
}
static const hsdp_backend fuzz_backend = {.name = "fuzz", .all_gather = no_gather};

#define MAX_SLOTS 4

static void die(const char *what, size_t i) {
    fprintf(stderr, "fuzz_checkpoint: %s (slot %zu): %s\n", what, i, hsdp_last_error());
    abort();
}

static int file_fd(const uint8_t *data, size_t size) {
    int fd = memfd_create("fuzz_checkpoint", MFD_CLOEXEC); /* owned by the caller */
    if (fd < 0) abort();
    size_t done = 0;
    while (done < size) {
        ssize_t n = write(fd, data + done, size - done);
        if (n <= 0) abort();
        done += (size_t)n;
    }
    return fd;
}

int LLVMFuzzerTestOneInput(const uint8_t *in, size_t len) {
    if (len < 3) return 0;
    int S = 1 + in[0] % 4, s = in[1] % S;
    size_t n = 1 + in[2] % MAX_SLOTS, pos = 3;
    if (len < pos + n * 7) return 0;
    size_t numels[MAX_SLOTS];
    hsdp_dtype dts[MAX_SLOTS], src[MAX_SLOTS];
    uint64_t offs[MAX_SLOTS];
    for (size_t i = 0; i < n; i++, pos += 7) {
        const uint8_t *p = in + pos;
        numels[i] = ((size_t)p[0] | (size_t)p[1] << 8) % 2048;
        dts[i] = (hsdp_dtype)(p[2] % HSDP_DTYPE_COUNT);
        src[i] = (hsdp_dtype)(p[3] % (HSDP_DTYPE_COUNT + 2)); /* a few invalid codes too */
        offs[i] = (uint64_t)p[4] | (uint64_t)p[5] << 8;
        if (p[6] & 1) offs[i] = UINT64_MAX - offs[i]; /* offsets near the top: wrap-around */
        else if (p[6] & 2) offs[i] += (uint64_t)1 << 62;
    }
    const uint8_t *file = in + pos;
    size_t fsize = len - pos;
    int fd = file_fd(file, fsize);

    hsdp_stats st;
    hsdp_stats_init(&st);
    hsdp_group g = {.backend = &fuzz_backend, .rank = s, .size = S};
    hsdp_unit u;
    if (hsdp_unit_init(&u, numels, dts, NULL, n, &g, &st) != HSDP_OK) die("unit init", 0);
    unsigned char *want = calloc(1, u.layout.chunk_bytes ? u.layout.chunk_bytes : 1); /* owned here */
    if (!want) abort();
    for (size_t i = 0; i <= n; i++) { /* i == n: out of range, refused */
        size_t nread = 12345;
        hsdp_status rc = hsdp_unit_read(&u, i, fd, i < n ? offs[i] : 0, i < n ? src[i] : HSDP_F32, &nread);
        if (i == n) {
            if (rc != HSDP_EINVAL || nread != 0) die("out-of-range slot accepted", i);
            break;
        }
        size_t item = hsdp_dtype_size(dts[i]), sitem = hsdp_dtype_size(src[i]);
        int compatible = sitem != 0 && (src[i] == dts[i] || (hsdp_dtype_is_float(src[i]) && hsdp_dtype_is_float(dts[i])));
        if (!compatible) {
            if (rc != HSDP_ETYPE || nread != 0) die("incompatible dtypes not refused", i);
            continue;
        }
        size_t b, e, coff;
        if (!hsdp_layout_owned(&u.layout, i, s, &b, &e, &coff)) {
            if (rc != HSDP_OK || nread != 0) die("a slot this rank does not own read something", i);
            continue;
        }
        uint64_t first = b / item, count = (e - b) / item;
        uint64_t start = offs[i] + first * sitem, bytes = count * sitem;
        /* nothing to read always works; otherwise no wrap, and inside the file */
        int fits = bytes == 0 || (offs[i] <= (uint64_t)INT64_MAX - (first + count) * sitem && start <= fsize &&
                                  bytes <= fsize - start);
        if (!fits) {
            if (rc == HSDP_OK) die("a read past the end of the file succeeded", i);
            continue; /* what a failed read leaves in the chunk is unspecified */
        }
        if (rc != HSDP_OK) die("a read inside the file failed", i);
        if (nread != bytes) die("wrong byte count", i);
        unsigned char *raw = malloc(bytes ? bytes : 1); /* owned here: aligned, unlike file + start */
        if (!raw) abort();
        memcpy(raw, file + start, bytes);
        hsdp_status cst = hsdp_cast(want + coff, dts[i], raw, src[i], count);
        free(raw);
        if (cst != HSDP_OK) die("reference cast", i);
        if (memcmp(u.shard + coff, want + coff, count * item) != 0) die("chunk differs from the file's bytes", i);
    }
    free(want);
    hsdp_unit_free(&u);
    close(fd);
    if (st.sharded_bytes != 0) die("accounting leak", 0);
    return 0;
}
