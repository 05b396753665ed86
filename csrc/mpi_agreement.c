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

/* ---- the exchange: tickets and chunks, a float8 wire gather's chunk in pieces ----
 * Each rank posts, to every peer, its ticket and its chunk; a float8 wire gather decoded as it
 * lands (`landing`) may send its chunk in pieces (plan_piece, when hsdp_wire_piece_bytes is set:
 * off by default; the ticket says how), so that a peer decodes each piece as it lands while
 * the next ones are in flight. A receiver cannot
 * know before a peer's ticket has landed how that peer split its chunk (it may ask for
 * another unit, or gather without the wire), so it posts, up front, the ticket and a receive
 * of its whole chunk, which the peer's first piece (or only message) lands in; once the
 * ticket is in, it posts the peer's further pieces, WINDOW at a time (the transport then moves
 * them one after the other, not all interleaved, so each lands as early as it can), each at
 * the place the peer's ticket says, clipped to this rank's share of the buffer. Every message
 * a peer sends is so received whatever the two asked for (one that does not fit truncates,
 * and the tickets then report the mismatch), so the ranks pair up again at the next gather.
 * A peer's chunk is decoded only while its ticket is the same as this rank's, never handed
 * out otherwise. MPI moves data (over TCP, say) only inside MPI calls, so the decode polls
 * (MPI_Testsome) between slices of its work.
 * Requests: the tickets' receives at [0, R) (R = n - 1, by peer position), then WINDOW piece
 * slots per peer, then the sends. */
enum { WINDOW = 2, PEERS = FUSED_RANKS - 1, SLOTS = PEERS * WINDOW,
       REQS = PEERS + SLOTS + PEERS * (1 + HSDP_WIRE_MAX_PIECES) };

/* This rank's piece for a wire chunk of nbytes decoded as it lands: at least
 * hsdp_wire_piece_bytes, at most HSDP_WIRE_MAX_PIECES of them, a multiple of 64; 0 (one
 * message) for a chunk of one piece or one MPI cannot count in bytes. */
static uint32_t plan_piece(size_t nbytes) {
    size_t min = hsdp_wire_piece_bytes();
    if (min == 0 || nbytes <= min || nbytes / HSDP_WIRE_MAX_PIECES >= (size_t)INT_MAX / 2) return 0;
    size_t p = (nbytes + HSDP_WIRE_MAX_PIECES - 1) / HSDP_WIRE_MAX_PIECES;
    p = p < min ? min : p;
    p = (p + 63) / 64 * 64;
    return p < nbytes ? (uint32_t)p : 0;
}

typedef struct {
    int ticket;                             /* 0: not in yet; 1: in; -1: its receive failed */
    int same;                               /* its ticket asks for what this rank's does */
    uint64_t pieces, posted, prefix;        /* it sends; posted here; landed in order from the first */
    unsigned char done[HSDP_WIRE_MAX_PIECES]; /* pieces landed (only a same ticket's are decoded) */
    size_t fed;                             /* bytes of its chunk handed to the decode */
    hsdp_wire_cursor cur;
} peer_state;

typedef struct {
    MPI_Request req[REQS];
    MPI_Status stat[REQS];
    int idx[REQS];
    unsigned char live[REQS];
    uint64_t slot_piece[SLOTS];
    peer_state peer[PEERS];
    hsdp_ticket *all;
    MPI_Comm comm;
    unsigned char *out;
    size_t nbytes;
    int n, me, R, m, active, failed;
} exchange;

static int peer_at(const exchange *x, int pos) { return pos < x->me ? pos : pos + 1; }
static int slot_of(const exchange *x, int p, uint64_t k) { return x->R + p * WINDOW + (int)(k % WINDOW); }

static int error_class(int rc) {
    int cls = rc;
    return MPI_Error_class(rc, &cls) == MPI_SUCCESS ? cls : rc;
}

static void posted(exchange *x, int k) {
    x->live[k] = 1;
    x->active++;
    if (k >= x->m) x->m = k + 1;
}

/* Piece k >= 1 of position p's chunk, where its ticket says, clipped to this rank's share. */
static int post_piece(exchange *x, int p, uint64_t k) {
    int j = peer_at(x, p), slot = slot_of(x, p, k);
    const hsdp_ticket *t = &x->all[j];
    uint64_t off = k * t->piece, len = t->nbytes - off < t->piece ? t->nbytes - off : t->piece;
    size_t o = off < x->nbytes ? (size_t)off : x->nbytes, c = len < x->nbytes - o ? (size_t)len : x->nbytes - o;
    int rc = MPI_Irecv(x->out + (size_t)j * x->nbytes + o, c > INT_MAX ? INT_MAX : (int)c, MPI_BYTE, j, TAG_CHUNK,
                       x->comm, &x->req[slot]);
    if (rc != MPI_SUCCESS) return rc;
    x->slot_piece[slot - x->R] = k;
    posted(x, slot);
    return MPI_SUCCESS;
}

/* Posts what the peers' tickets ask for, as the window allows (never while a batch of
 * completions is being read: a slot it frees may not be reused before its own is read). */
static void post_more(exchange *x) {
    for (int p = 0; p < x->R; p++) {
        peer_state *ps = &x->peer[p];
        while (ps->ticket == 1 && ps->posted < ps->pieces && x->req[slot_of(x, p, ps->posted)] == MPI_REQUEST_NULL) {
            int rc = post_piece(x, p, ps->posted);
            if (rc != MPI_SUCCESS) { /* out of resources: the peer's send then waits until the watchdog ends it */
                if (x->failed == MPI_SUCCESS) x->failed = rc;
                ps->pieces = ps->posted;
                break;
            }
            ps->posted++;
        }
    }
}

/* Request k ended with error e. */
static void complete(exchange *x, int k, int e) {
    x->live[k] = 0;
    x->active--;
    if (e != MPI_SUCCESS && x->failed == MPI_SUCCESS) x->failed = e;
    if (k >= x->R * (1 + WINDOW)) return; /* a send */
    if (k < x->R) {
        peer_state *ps = &x->peer[k];
        const hsdp_ticket *t = &x->all[peer_at(x, k)];
        ps->ticket = e == MPI_SUCCESS ? 1 : -1;
        if (e != MPI_SUCCESS) return;
        ps->pieces = t->piece ? (t->nbytes + t->piece - 1) / t->piece : 1;
        ps->same = hsdp_ticket_same(t, &x->all[x->me]);
        return;
    }
    peer_state *ps = &x->peer[(k - x->R) / WINDOW];
    uint64_t piece = x->slot_piece[k - x->R];
    if (piece < HSDP_WIRE_MAX_PIECES) ps->done[piece] = 1;
    while (ps->prefix < HSDP_WIRE_MAX_PIECES && ps->done[ps->prefix]) ps->prefix++;
}

/* Reads what completed (MPI_Waitsome when `block`, else MPI_Testsome), then posts what that
 * allows. An error that does not say which request failed: each is then waited alone. */
static void progress(exchange *x, int block) {
    int outcount = 0;
    int rc = block ? MPI_Waitsome(x->m, x->req, &outcount, x->idx, x->stat)
                   : MPI_Testsome(x->m, x->req, &outcount, x->idx, x->stat);
    int in_status = rc != MPI_SUCCESS && error_class(rc) == MPI_ERR_IN_STATUS;
    if (rc != MPI_SUCCESS && !in_status) {
        if (x->failed == MPI_SUCCESS) x->failed = rc;
        for (int k = 0; k < x->m; k++)
            if (x->live[k]) complete(x, k, MPI_Wait(&x->req[k], MPI_STATUS_IGNORE));
    } else {
        for (int c = 0; c < outcount && outcount != MPI_UNDEFINED; c++)
            complete(x, x->idx[c], in_status ? x->stat[c].MPI_ERROR : MPI_SUCCESS);
    }
    post_more(x);
}

static void poll_landed(void *arg) {
    exchange *x = arg;
    if (x->failed == MPI_SUCCESS) progress(x, 0);
}

/* Bytes of position p's chunk landed in order from its start. */
static size_t landed_bytes(const exchange *x, int p) {
    const peer_state *ps = &x->peer[p];
    const hsdp_ticket *t = &x->all[peer_at(x, p)];
    if (ps->ticket != 1 || ps->prefix == 0) return 0;
    uint64_t b = t->piece ? ps->prefix * (uint64_t)t->piece : t->nbytes;
    return b < x->nbytes ? (size_t)b : x->nbytes;
}

/* Decodes this rank's chunk, then each peer's piece by piece as it lands, until every request
 * has ended (a failure stops the decode, not the wait). */
static hsdp_status decode_as_landed(exchange *x, hsdp_gather_req *landing, const void *send) {
    hsdp_status st = hsdp_unit_decode_landed(landing, x->me, send, poll_landed, x);
    for (;;) {
        int fed = 0;
        for (int p = 0; p < x->R && st == HSDP_OK && x->failed == MPI_SUCCESS; p++) {
            peer_state *ps = &x->peer[p];
            size_t landed = landed_bytes(x, p);
            if (!ps->same || ps->cur.done || landed <= ps->fed) continue;
            ps->fed = landed;
            int j = peer_at(x, p);
            st = hsdp_unit_decode_prefix(landing, j, x->out + (size_t)j * x->nbytes, landed, &ps->cur, poll_landed, x);
            fed = 1;
        }
        if (fed) continue;
        if (x->active == 0) return st;
        progress(x, 1);
    }
}

/* Without a decode: every request posted so far at once, then what the tickets still ask for. After
 * an error Open MPI's MPI_Waitall returns with the rest still pending (the standard allows
 * it: MPI_ERR_PENDING); every request must end before its buffer can, so those are waited for
 * one by one. */
static void wait_all(exchange *x) {
    int wrc = MPI_Waitall(x->m, x->req, x->stat);
    int in_status = wrc != MPI_SUCCESS && error_class(wrc) == MPI_ERR_IN_STATUS;
    for (int k = 0; k < x->m; k++) {
        if (!x->live[k]) continue;
        int e = MPI_SUCCESS;
        if (wrc != MPI_SUCCESS) {
            e = in_status ? x->stat[k].MPI_ERROR : wrc;
            if (!in_status || error_class(e) == MPI_ERR_PENDING) e = MPI_Wait(&x->req[k], MPI_STATUS_IGNORE);
        }
        complete(x, k, e);
    }
    post_more(x);
    while (x->active > 0) progress(x, 1);
}

/* The gather with the tickets beside the data, in one exchange (groups of up to FUSED_RANKS).
 * landing: a float8 wire gather, decoded as it lands (above). */
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
    } else if (landing) {
        all[me].piece = plan_piece(nbytes);
    }
    exchange *x = &(exchange){.all = all, .comm = comm_of(g), .out = recv, .nbytes = nbytes, .n = n, .me = me,
                              .R = n - 1, .failed = MPI_SUCCESS};
    for (int k = 0; k < REQS; k++) x->req[k] = MPI_REQUEST_NULL;
    const unsigned char *mine = send;
    uint32_t piece = all[me].piece;
    uint64_t pieces = piece ? (nbytes + piece - 1) / piece : 1;
    int rc = MPI_SUCCESS, s = x->R * (1 + WINDOW); /* the sends' requests from s */
    hsdp_mpi_watch_begin("MPI_Isend/MPI_Irecv (a gather, tickets beside the data)", g, nbytes * (size_t)n);
    for (int p = 0; p < x->R && rc == MPI_SUCCESS; p++) {
        int j = peer_at(x, p);
        if ((rc = MPI_Irecv(&all[j], (int)sizeof *all, MPI_BYTE, j, TAG_TICKET, x->comm, &x->req[p])) != MPI_SUCCESS)
            break;
        posted(x, p);
        /* the whole chunk: the peer's first piece, or its only message, whatever its size */
        int slot = slot_of(x, p, 0);
        if ((rc = MPI_Irecv(x->out + (size_t)j * nbytes, count, type, j, TAG_CHUNK, x->comm, &x->req[slot])) !=
            MPI_SUCCESS)
            break;
        posted(x, slot);
        x->peer[p].posted = 1;
    }
    for (int d = 1; d < n && rc == MPI_SUCCESS; d++) { /* peers in ring order spread the load */
        int j = (me + d) % n;
        if ((rc = MPI_Isend(&all[me], (int)sizeof *all, MPI_BYTE, j, TAG_TICKET, x->comm, &x->req[s])) != MPI_SUCCESS)
            break;
        posted(x, s++);
        for (uint64_t k = 0; k < pieces && rc == MPI_SUCCESS; k++) {
            size_t off = (size_t)k * piece, len = piece && nbytes - off > piece ? piece : nbytes - off;
            rc = piece ? MPI_Isend(mine + off, (int)len, MPI_BYTE, j, TAG_CHUNK, x->comm, &x->req[s])
                       : MPI_Isend(send, count, type, j, TAG_CHUNK, x->comm, &x->req[s]);
            if (rc == MPI_SUCCESS) posted(x, s++);
        }
    }
    /* (Should posting fail, out of resources, the peers wait for what was never sent until the
     * watchdog ends the job.) */
    if (rc != MPI_SUCCESS) x->failed = rc;
    hsdp_status decode_st = HSDP_OK;
    if (landing && rc == MPI_SUCCESS && !size_error[0])
        decode_st = decode_as_landed(x, landing, send);
    else
        wait_all(x);
    hsdp_watch_end();
    if (owned) MPI_Type_free(&type);
    /* A ticket cannot truncate (every one is 64 bytes), so after any other error the tickets
     * still say whether the ranks asked for different units, which is the error to report. */
    int tickets_ok = 1;
    for (int p = 0; p < x->R; p++) tickets_ok &= x->peer[p].ticket == 1;
    if (tickets_ok) {
        hsdp_status st = hsdp_tickets_check(g, all);
        if (st != HSDP_OK) return st;
    }
    if (size_error[0]) return hsdp_fail(HSDP_EINVAL, "%s", size_error);
    if (x->failed != MPI_SUCCESS) return hsdp_mpi_fail(x->failed, "MPI_Isend/MPI_Irecv (gathering)");
    if (decode_st != HSDP_OK) return decode_st;
    /* The rank's own chunk last: MPI progresses (over TCP, say) only inside MPI calls, and a
     * copy while the messages are in flight would stall them. (Decoded as they landed: the
     * chunks are already in `full`.) */
    if (!landing && x->out + (size_t)me * nbytes != mine) memcpy(x->out + (size_t)me * nbytes, send, nbytes);
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
