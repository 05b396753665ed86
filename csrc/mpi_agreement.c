/* mpi_agreement.c - the MPI backend's unit gathers with their tickets (mpi_internal.h). */
#if defined(HSDP_HAVE_MPI)
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mpi_internal.h"
#include "watchdog.h"
#include "agreement.h"

/* ---------------------------------------------------------------- agreement */
/* MPI's tickets (agreement.h). In a group of up to FUSED_RANKS ranks the tickets travel with
 * the data: each rank posts, to every peer, a ticket message and a data message at once, so
 * the check costs no extra round trip (an MPI_Allgather cannot carry them without copying
 * every chunk). Each receive has a matching send whatever the peers asked for, so a
 * mismatch, even of sizes, completes on every rank and is reported from the tickets, never
 * as a truncation. Larger groups exchange the tickets in their own 64-byte all-gather first
 * (hsdp_agree), then gather with MPI_Allgather, whose ring and doubling algorithms scale where
 * a rank posting to every peer may not. Direct gathers need no check: each rank reads its
 * peers' shards of its own unit. */
enum { FUSED_RANKS = 8, TAG_TICKET = 0x4854, TAG_CHUNK = 0x4855 };

/* The tickets' own all-gather (groups of more than FUSED_RANKS, or HSDP_AGREE_SEPARATE). */
static hsdp_status ticket_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    hsdp_mpi_watch_begin("MPI_Allgather (agreeing on the unit to gather)", g, nbytes * (size_t)g->size);
    int rc = MPI_Allgather(send, (int)nbytes, MPI_BYTE, recv, (int)nbytes, MPI_BYTE, comm_of(g));
    hsdp_watch_end();
    return rc == MPI_SUCCESS ? HSDP_OK : hsdp_mpi_fail(rc, "MPI_Allgather (agreeing on the unit to gather)");
}

static int error_class(int rc) {
    int cls = rc;
    return MPI_Error_class(rc, &cls) == MPI_SUCCESS ? cls : rc;
}

/* ---- a float8 wire gather decoded as its chunks land ----
 * This rank's chunk is decoded while the peers' are in flight, each peer's as soon as both its
 * ticket and its chunk are in and the ticket equals this rank's (so nothing of a unit the
 * ranks disagree on is decoded; the gather then fails as before). MPI moves data (over TCP,
 * say) only inside MPI calls, so the decode polls the requests (MPI_Testsome) between slices.
 * Request k < 2 (n - 1) is a receive from the peer at position k / 2 (tickets at even k). */
typedef struct {
    MPI_Request *req;
    MPI_Status *stat;
    int m, n, me;
    int failed, tickets_ok;         /* the first error seen; whether every ticket arrived */
    int got[FUSED_RANKS];           /* per peer position: 1 ticket in, 2 chunk in (bits) */
    int ready[FUSED_RANKS], nready; /* peers whose ticket and chunk are in, in landing order */
} landing_state;

static int peer_at(const landing_state *ls, int pos) { return pos < ls->me ? pos : pos + 1; }

/* Records what completed (outcount indices in idx, or an error from a Testsome/Waitsome). */
static void landed(landing_state *ls, int rc, int outcount, const int *idx) {
    int in_status = rc != MPI_SUCCESS && error_class(rc) == MPI_ERR_IN_STATUS;
    if (rc != MPI_SUCCESS && !in_status) { /* which request failed is unknown: the cleanup waits the rest */
        if (ls->failed == MPI_SUCCESS) ls->failed = rc;
        return;
    }
    for (int c = 0; c < outcount && outcount != MPI_UNDEFINED; c++) {
        int k = idx[c], e = in_status ? ls->stat[c].MPI_ERROR : MPI_SUCCESS;
        if (e != MPI_SUCCESS) {
            if (ls->failed == MPI_SUCCESS) ls->failed = e;
            if (k < 2 * (ls->n - 1) && k % 2 == 0) ls->tickets_ok = 0;
            continue;
        }
        if (k >= 2 * (ls->n - 1)) continue; /* a send */
        int pos = k / 2;
        ls->got[pos] |= k % 2 ? 2 : 1;
        if (ls->got[pos] == 3) ls->ready[ls->nready++] = pos;
    }
}

static void landing_poll(void *arg) {
    landing_state *ls = arg;
    if (ls->failed != MPI_SUCCESS) return;
    int outcount = 0, idx[4 * (FUSED_RANKS - 1)];
    int rc = MPI_Testsome(ls->m, ls->req, &outcount, idx, ls->stat);
    landed(ls, rc, outcount, idx);
}

/* Decodes this rank's chunk, then each peer's as it lands, until every one is decoded or an
 * error ends the wait (the caller's cleanup then waits what is left). */
static hsdp_status decode_as_landed(landing_state *ls, hsdp_gather_req *landing, const hsdp_ticket *all,
                                    const void *send, const unsigned char *out, size_t nbytes) {
    hsdp_status st = hsdp_unit_decode_landed(landing, ls->me, send, landing_poll, ls);
    for (int next = 0; st == HSDP_OK && ls->failed == MPI_SUCCESS && next < ls->n - 1;) {
        if (next < ls->nready) {
            int j = peer_at(ls, ls->ready[next++]);
            if (memcmp(&all[j], &all[ls->me], sizeof *all) == 0) /* else the ticket check fails the gather */
                st = hsdp_unit_decode_landed(landing, j, out + (size_t)j * nbytes, landing_poll, ls);
            continue;
        }
        int outcount = 0, idx[4 * (FUSED_RANKS - 1)];
        int rc = MPI_Waitsome(ls->m, ls->req, &outcount, idx, ls->stat);
        if (rc == MPI_SUCCESS && outcount == MPI_UNDEFINED) break; /* nothing left (cannot happen here) */
        landed(ls, rc, outcount, idx);
    }
    return st;
}

/* The gather with the tickets beside the data, in one exchange (groups of up to FUSED_RANKS).
 * landing: see decode_as_landed. */
static hsdp_status agreed_gather(hsdp_group *g, const char *label, uint64_t ident, const void *send, void *recv,
                                 size_t nbytes, hsdp_gather_req *landing) {
    REQUIRE_LIVE();
    int count, owned, n = g->size, me = g->rank;
    MPI_Datatype type;
    hsdp_ticket all[FUSED_RANKS];
    all[me] = hsdp_ticket_make(g, label, ident, nbytes);
    /* A size MPI cannot carry still takes part, with no data: were it a mismatch, the peers
     * must still see this rank's ticket, not wait for it until the watchdog fires. */
    char size_error[256] = "";
    if (hsdp_mpi_byte_count(nbytes, &count, &type, &owned) != HSDP_OK) {
        snprintf(size_error, sizeof size_error, "%s", hsdp_last_error());
        count = 0, type = MPI_BYTE, owned = 0;
    }
    MPI_Request req[4 * (FUSED_RANKS - 1)];
    MPI_Comm comm = comm_of(g);
    unsigned char *out = recv;
    int m = 0, rc = MPI_SUCCESS; /* req[0..m) were posted: ticket receives at the even k < 2 (n - 1) */
    hsdp_mpi_watch_begin("MPI_Isend/MPI_Irecv (a gather, tickets beside the data)", g, nbytes * (size_t)n);
    for (int j = 0; j < n && rc == MPI_SUCCESS; j++) {
        if (j == me) continue;
        if ((rc = MPI_Irecv(&all[j], (int)sizeof *all, MPI_BYTE, j, TAG_TICKET, comm, &req[m])) != MPI_SUCCESS) break;
        m++;
        if ((rc = MPI_Irecv(out + (size_t)j * nbytes, count, type, j, TAG_CHUNK, comm, &req[m])) != MPI_SUCCESS) break;
        m++;
    }
    for (int d = 1; d < n && rc == MPI_SUCCESS; d++) { /* peers in ring order spread the load */
        int j = (me + d) % n;
        if ((rc = MPI_Isend(&all[me], (int)sizeof *all, MPI_BYTE, j, TAG_TICKET, comm, &req[m])) != MPI_SUCCESS) break;
        m++;
        if ((rc = MPI_Isend(send, count, type, j, TAG_CHUNK, comm, &req[m])) != MPI_SUCCESS) break;
        m++;
    }
    /* After an error Open MPI's MPI_Waitall returns with the rest still pending (the standard
     * allows it: MPI_ERR_PENDING); every request must end before its buffer can, so those
     * are waited for one by one. (Should posting fail, out of resources, the peers wait for
     * what was never sent until the watchdog ends the job.) */
    MPI_Status stat[4 * (FUSED_RANKS - 1)];
    int failed = rc, tickets_ok = rc == MPI_SUCCESS;
    hsdp_status decode_st = HSDP_OK;
    if (landing && rc == MPI_SUCCESS && !size_error[0]) {
        landing_state ls = {.req = req, .stat = stat, .m = m, .n = n, .me = me, .tickets_ok = 1};
        decode_st = decode_as_landed(&ls, landing, all, send, out, nbytes);
        failed = ls.failed;
        tickets_ok = ls.tickets_ok;
    }
    /* what is left (completed requests are MPI_REQUEST_NULL, which complete at once) */
    int wrc = MPI_Waitall(m, req, stat);
    int in_status = wrc != MPI_SUCCESS && error_class(wrc) == MPI_ERR_IN_STATUS;
    for (int k = 0; wrc != MPI_SUCCESS && k < m; k++) {
        int e = in_status ? stat[k].MPI_ERROR : wrc;
        if (!in_status || error_class(e) == MPI_ERR_PENDING) e = MPI_Wait(&req[k], MPI_STATUS_IGNORE);
        if (e == MPI_SUCCESS) continue;
        if (failed == MPI_SUCCESS) failed = e;
        if (k < 2 * (n - 1) && k % 2 == 0) tickets_ok = 0; /* a ticket's receive */
    }
    hsdp_watch_end();
    if (owned) MPI_Type_free(&type);
    /* A ticket cannot truncate (every one is 64 bytes), so after any other error the tickets
     * still say whether the ranks asked for different units, which is the error to report. */
    if (tickets_ok) {
        hsdp_status st = hsdp_tickets_check(g, all);
        if (st != HSDP_OK) return st;
    }
    if (size_error[0]) return hsdp_fail(HSDP_EINVAL, "%s", size_error);
    if (failed != MPI_SUCCESS) return hsdp_mpi_fail(failed, "MPI_Isend/MPI_Irecv (gathering)");
    if (decode_st != HSDP_OK) return decode_st;
    /* The rank's own chunk last: MPI progresses (over TCP, say) only inside MPI calls, and a
     * copy while the messages are in flight would stall them. (Decoded as they landed: the
     * chunks are already in `full`.) */
    if (!landing && out + (size_t)me * nbytes != (const unsigned char *)send) memcpy(out + (size_t)me * nbytes, send, nbytes);
    hsdp_mpi_collective_done(g); /* every peer sent to this rank, so every one entered the gather */
    return HSDP_OK;
}

/* On the worker. The first gather of a fixed chunk is collective and sets *share. */
hsdp_status hsdp_mpi_fixed_gather(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                const char *label, uint64_t ident, hsdp_gather_req *landing) {
    if (*share && *share != hsdp_share_collective())
        return hsdp_mpi_direct_gather(g, *share, send, recv, nbytes, landing);
    hsdp_status st = HSDP_OK;
    int mode = g->size > 1 ? hsdp_agreement_check() : HSDP_AGREE_OFF;
    hsdp_watch_label(label, !*share); /* a stalled peer is first seen here: name the unit */
    if (mode == HSDP_AGREE_ON && g->size <= FUSED_RANKS) {
        st = agreed_gather(g, label, ident, send, recv, nbytes, landing);
    } else {
        if (mode != HSDP_AGREE_OFF) {
            st = hsdp_agree(g, label, ident, nbytes, ticket_all_gather);
            hsdp_watch_label(label, !*share);
        }
        if (st == HSDP_OK) st = hsdp_mpi_raw_all_gather(g, send, recv, nbytes);
    }
    if (st == HSDP_OK && !*share) st = hsdp_mpi_direct_setup(g, share, send, nbytes);
    return st;
}
#endif
