/* peer_status.h - what this rank waits in, answered over TCP to its peers' watchdogs.
 *
 * When a collective outlives HSDP_TIMEOUT, the watchdog names the ranks that never arrived.
 * Peers on the same host it reads by pid (watchdog.c); a peer on another host it asks:
 * every rank of a job of two or more serves a small TCP answer on an ephemeral port, on a
 * thread of its own, and the ranks exchange their cards at the world's start. Only a
 * caller that sends the peer's cookie (which only the job's ranks learnt) gets an answer,
 * and the answer is one line: what the rank waits in, or that it waits in nothing. Best
 * effort: a peer that does not answer in time stays "unknown". */
#ifndef HSDP_PEER_STATUS_H
#define HSDP_PEER_STATUS_H

#include <stddef.h>
#include <stdint.h>

enum { HSDP_STATUS_ADDRS = 4 };

/* Where a rank answers: exchanged as plain 64-bit words, so it is 6 of them. */
typedef struct {
    uint64_t cookie;                   /* 0: this rank serves no answer */
    uint64_t port;                     /* TCP, host order */
    uint64_t addr[HSDP_STATUS_ADDRS];  /* IPv4 addresses in host order, 0 for none */
} hsdp_status_card;
_Static_assert(sizeof(hsdp_status_card) == 6 * sizeof(uint64_t), "a card is 6 words");

/* Fills *what (at most n bytes with the NUL) with what the rank waits in; returns 1 when it
 * waits in a collective, 0 when in none. Called on the answering thread. */
typedef int (*hsdp_status_describe)(char *what, size_t n);

/* Starts answering (once per process); *card says where, or has cookie 0 when the socket or
 * thread could not be made (peers then see this rank as unknown). */
void hsdp_status_serve(hsdp_status_describe describe, hsdp_status_card *card);

/* Stops answering and closes the socket (before MPI_Finalize; idempotent). */
void hsdp_status_stop(void);

/* Asks the peer: 1 with *active and what (NUL-terminated, at most n bytes) filled in; 0 when
 * it did not answer within timeout_ms in all (every address tried in turn). */
int hsdp_status_ask(const hsdp_status_card *peer, int timeout_ms, int *active, char *what, size_t n);

#endif
