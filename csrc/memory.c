/* memory.c - the core's own memory accounting and the host allocator for unsharded buffers.
 * The counters are atomic: the MPI worker thread and the Python thread both update them. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "hsdp.h"

int hsdp_trim_memory(void) {
#if defined(__GLIBC__)
    /* glibc keeps freed heap memory (many mid-size arrays, say) for reuse; after sharding
     * the full weights are gone for good, so give their pages back. */
    return malloc_trim(0);
#else
    return 0;
#endif
}

void hsdp_stats_init(hsdp_stats *st) {
    atomic_init(&st->sharded_bytes, 0);
    atomic_init(&st->unsharded_bytes, 0);
    atomic_init(&st->peak_unsharded_bytes, 0);
    atomic_init(&st->whole_bytes, 0);
    atomic_init(&st->pooled_bytes, 0);
    atomic_init(&st->buffer_allocs, 0);
    atomic_init(&st->gathers, 0);
}

void hsdp_stats_note_unsharded(hsdp_stats *st, size_t nbytes) {
    size_t now = atomic_fetch_add(&st->unsharded_bytes, nbytes) + nbytes;
    size_t peak = atomic_load(&st->peak_unsharded_bytes);
    /* Running max: retry only while our value is still the larger; a failed exchange
     * reloads `peak` with the current value. */
    while (now > peak && !atomic_compare_exchange_weak(&st->peak_unsharded_bytes, &peak, now)) {
    }
}

void hsdp_stats_count_alloc(hsdp_stats *st, size_t nbytes) {
    hsdp_stats_note_unsharded(st, nbytes);
    atomic_fetch_add(&st->buffer_allocs, 1);
}

void hsdp_stats_count_free(hsdp_stats *st, size_t nbytes) { atomic_fetch_sub(&st->unsharded_bytes, nbytes); }

void *hsdp_buffer_alloc(hsdp_stats *st, size_t nbytes) {
    /* aligned_alloc wants a size that is a multiple of the alignment; 0 becomes one line so
     * the caller always gets a distinct, freeable pointer. */
    if (nbytes > SIZE_MAX - (HSDP_ALIGN - 1)) {
        hsdp_fail(HSDP_ENOMEM, "could not allocate %zu bytes for an unsharded buffer", nbytes);
        return NULL;
    }
    size_t rounded = (nbytes + (HSDP_ALIGN - 1)) & ~(size_t)(HSDP_ALIGN - 1);
    if (rounded == 0) rounded = HSDP_ALIGN;

    /* Owned by the caller from here on; released by hsdp_buffer_free. */
    void *p = aligned_alloc(HSDP_ALIGN, rounded);
    if (p == NULL) {
        hsdp_fail(HSDP_ENOMEM, "could not allocate %zu bytes for an unsharded buffer", nbytes);
        return NULL;
    }
    /* Account what was asked for (not the padding), so free with the same nbytes balances. */
    hsdp_stats_count_alloc(st, nbytes);
    return p;
}

void hsdp_buffer_free(hsdp_stats *st, void *p, size_t nbytes) {
    /* Like free(NULL): nothing was allocated, so nothing is un-accounted either. */
    if (p == NULL) return;
    hsdp_stats_count_free(st, nbytes);
    free(p);
}
