/* agreement.h - every rank of a group gathers the same unit, on every backend.
 *
 * [Note: agreement] (docs/design.md, "Agreement on collective gathers", points here.)
 * Every collective unit gather carries a ticket: the unit's name, its identity (which unit of
 * the group it is, counted as made: two models of one architecture have units of the same
 * names and sizes), the group's count of unit gathers so far and the bytes per rank. Ranks
 * that disagree (one unsharding blocks.0 while another unshards blocks.1, one the first
 * model's blocks.0 while another the second's, or a rank that skipped a gather after
 * catching an exception) all see every ticket, so every one of them fails, naming what each
 * asked for, and none hands out the gathered buffer: no rank returns weights mixed from two
 * units. How the tickets travel is the backend's (MPI: beside the data, mpi_agreement.c;
 * NCCL: a second all-gather in the same NCCL group as the data, nccl_agreement.c); without a
 * way of its own a backend exchanges them in their own all-gather first (hsdp_agree). The
 * mode (hsdp_set_agreement_check, backend.h) must be the same on every rank of a group.
 *
 * The ticket: 64 bytes per rank (hsdp_ticket_make, hsdp_tickets_check): the name's first 31
 * bytes and a hash of all of it, the identity (32 bits), the group's gather count and the
 * bytes per rank. Where it rides: MPI, beside the data in the same exchange for groups of up
 * to 8 ranks (every receive has its matching send whatever the peers asked for, so even a
 * mismatch of sizes completes everywhere and is reported from the tickets), or in its own
 * 64-byte all-gather first for larger groups; NCCL, a second ncclAllGather of 64 bytes per
 * rank in the same ncclGroupStart/End as the data, copied back to pinned host memory on the
 * side stream and compared when the host waits ([Note: tickets checked late],
 * nccl_agreement.c); any other backend, hsdp_agree before the data. What a mismatch does:
 * every rank of the group fails with the same message, none hands out the buffer; on NCCL a
 * mismatch of sizes also aborts the communicators. A float8 wire gather on MPI decodes a
 * peer's chunk as it lands only once that peer's ticket equals this rank's. The ticket also
 * carries how its sender split its chunk into pieces (MPI's float8 wire, off by default):
 * what a receiver must post, never compared. */
#ifndef HSDP_AGREEMENT_H
#define HSDP_AGREEMENT_H

#include "backend.h"

enum { HSDP_TICKET_LABEL = 32, HSDP_TICKET_BYTES = 64 };
/* piece: how the sender splits its chunk on the wire (MPI, mpi_agreement.c: 0, one message; else
 * messages of `piece` bytes, the last shorter), so that a receiver pairs every message of a
 * peer whatever the two asked for. It is the transport's, not part of what must agree. */
typedef struct {
    uint64_t seq, nbytes, label_hash;
    uint32_t ident, piece;
    char label[HSDP_TICKET_LABEL];
} hsdp_ticket;
_Static_assert(sizeof(hsdp_ticket) == HSDP_TICKET_BYTES, "a ticket is 64 bytes");

/* This rank's ticket for its next unit gather on g (counts it: g->unit_gathers). */
hsdp_ticket hsdp_ticket_make(hsdp_group *g, const char *label, uint64_t ident, size_t nbytes);
/* Whether two tickets ask for the same gather (everything but the piece). */
int hsdp_ticket_same(const hsdp_ticket *a, const hsdp_ticket *b);
/* HSDP_OK when every one of the g->size tickets is the same as rank 0's; else HSDP_ECOMM naming what
 * each rank that differs (and rank 0) asked for. */
hsdp_status hsdp_tickets_check(const hsdp_group *g, const hsdp_ticket *all);
/* The same, for tickets compared after the gather's wait returned (late): the message says so. */
hsdp_status hsdp_tickets_check_late(const hsdp_group *g, const hsdp_ticket *all, int late);
/* The tickets in their own all-gather (through `gather`, the backend's), checked, before the
 * data is gathered: one round trip more, but it works on any backend. */
typedef hsdp_status (*hsdp_gather_fn)(hsdp_group *g, const void *send, void *recv, size_t nbytes);
hsdp_status hsdp_agree(hsdp_group *g, const char *label, uint64_t ident, size_t nbytes, hsdp_gather_fn gather);

#endif
