/* agreement.c - the tickets of unit gathers, for every backend (agreement.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agreement.h"
#include "peer_read.h"

hsdp_ticket hsdp_ticket_make(hsdp_group *g, const char *label, uint64_t ident, size_t nbytes) {
    hsdp_ticket mine;
    memset(&mine, 0, sizeof mine);
    mine.seq = ++g->unit_gathers;
    mine.nbytes = nbytes;
    mine.ident = (uint32_t)ident; /* units made over one group: never near 2^32 */
    label = label ? label : "";
    mine.label_hash = hsdp_fnv1a(1469598103934665603ull, label, strlen(label)); /* names longer than the copy */
    snprintf(mine.label, sizeof mine.label, "%s", label);
    return mine;
}

int hsdp_ticket_same(const hsdp_ticket *a, const hsdp_ticket *b) {
    return a->seq == b->seq && a->nbytes == b->nbytes && a->label_hash == b->label_hash && a->ident == b->ident &&
           memcmp(a->label, b->label, sizeof a->label) == 0;
}

hsdp_status hsdp_tickets_check(const hsdp_group *g, const hsdp_ticket *all) { return hsdp_tickets_check_late(g, all, 0); }

hsdp_status hsdp_tickets_check_late(const hsdp_group *g, const hsdp_ticket *all, int late) {
    int differ = 0;
    for (int j = 1; j < g->size; j++) differ |= !hsdp_ticket_same(&all[j], &all[0]);
    if (!differ) return HSDP_OK;
    char msg[900];
    size_t used = (size_t)snprintf(msg, sizeof msg, "the %d ranks of a group do not gather the same unit, %s:", g->size,
                                   late ? "found after the gather's wait had returned (its buffer holds mixed weights: "
                                          "the forward that read it is void)"
                                        : "so none of them gathers");
    for (int j = 0, shown = 0; j < g->size && used < sizeof msg; j++) {
        /* every rank that differs from rank 0, and rank 0, at most 6 in all */
        if (j && hsdp_ticket_same(&all[j], &all[0])) continue;
        if (shown++ == 6) {
            used += (size_t)snprintf(msg + used, sizeof msg - used, " ...");
            break;
        }
        used += (size_t)snprintf(msg + used, sizeof msg - used, "%s rank %d asks for unit '%.*s' (the group's unit "
                                 "#%llu as made, %llu bytes per rank, its gather #%llu on this group)", j ? ";" : "",
                                 j, HSDP_TICKET_LABEL - 1, all[j].label, (unsigned long long)all[j].ident,
                                 (unsigned long long)all[j].nbytes, (unsigned long long)all[j].seq);
    }
    return hsdp_fail(HSDP_ECOMM, "%s", msg);
}

enum { TICKETS_ON_STACK = 16 };

hsdp_status hsdp_agree(hsdp_group *g, const char *label, uint64_t ident, size_t nbytes, hsdp_gather_fn gather) {
    hsdp_ticket mine = hsdp_ticket_make(g, label, ident, nbytes);
    hsdp_ticket stack[TICKETS_ON_STACK];
    hsdp_ticket *all = g->size <= TICKETS_ON_STACK ? stack : malloc(sizeof *all * (size_t)g->size); /* freed below */
    if (!all) return hsdp_fail(HSDP_ENOMEM, "could not allocate the agreement of %d ranks", g->size);
    hsdp_status st = gather(g, &mine, all, sizeof mine);
    if (st == HSDP_OK) st = hsdp_tickets_check(g, all);
    if (all != stack) free(all);
    return st;
}
