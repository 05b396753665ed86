/* watchdog.h - bounded waits that name who is missing, for every backend.
 *
 * A collective waits for every rank of its group; a peer that stalls, hangs or is a step
 * behind would make it wait forever. Each backend bounds its waits by HSDP_TIMEOUT
 * (hsdp_timeout_ns) its own way (MPI: a thread here, started with the world, that ends the
 * job; NCCL: its own watchdog, which aborts the communicators). What they share lives here:
 *   - what this rank waits in, published for its peers: read by pid on the same host
 *     (process_vm_readv, peer_read.h), asked over TCP from other hosts (peer_status.h);
 *   - the world's peer records (pid, address of that publication, host, status card),
 *     exchanged once at world start by the backend's own all-gather;
 *   - naming who did not arrive: a peer of the group not waiting in the same collective is
 *     named, with what it waits in instead (if anything); peers that neither can be read nor
 *     answer are listed as unknown. Best effort: it runs just before the job fails. */
#ifndef HSDP_WATCHDOG_H
#define HSDP_WATCHDOG_H

#include <stddef.h>
#include <stdint.h>

#include "peer_status.h"

/* ---------------------------------------------------------------- what this rank waits in */
/* What the next watched wait is for (a unit's gather, finalising), named if it times out. */
void hsdp_watch_next(const char *what);
void hsdp_watch_label(const char *label, int first);
/* Brackets one wait timed by the thread below (one at a time: MPI calls are serialised):
 * "OP of NBYTES bytes over a group of SIZE ranks (NEXT)". ranks: the world rank of each of
 * the size ranks taking part (NULL: none can be named); it must outlive the wait. */
void hsdp_watch_begin(const char *op, const int *ranks, int size, size_t nbytes);
void hsdp_watch_end(void);
/* For a backend that times its waits itself (NCCL): publishes what it waits in now (NULL or
 * "": nothing), for the peers' watchdogs. */
void hsdp_watch_publish(const char *what);

/* The thread that times hsdp_watch_begin's waits: past HSDP_TIMEOUT it prints, on stderr,
 * what waited and who is missing, then calls expire, which must end the job (MPI_Abort).
 * world_rank names this rank in the message. Idempotent; stopped by hsdp_watch_stop_thread. */
void hsdp_watch_start_thread(int world_rank, void (*expire)(void));
void hsdp_watch_stop_thread(void);

/* ---------------------------------------------------------------- the world's peers */
/* A rank's record, plain words, all-gathered over the world by the backend at world start. */
enum { HSDP_PEER_WORDS = 4 + sizeof(hsdp_status_card) / sizeof(uint64_t) };
/* This rank's record (starts answering status asks: hsdp_status_serve). */
void hsdp_peers_mine(uint64_t mine[HSDP_PEER_WORDS]);
/* The n records of the world (copied), this rank being world rank `me`. The first call wins:
 * one world per process, whichever backend learns it first. 0, or -1 without memory. */
int hsdp_peers_learn(const uint64_t *all, int n, int me);
/* Whether the peers are known (a world of 2 or more ranks learned them). */
int hsdp_peers_known(void);
/* Writes "; not in it: rank R (waiting in X | in no collective), ..." (and the unknown ranks)
 * into out: who of ranks[0..size) does not wait in `what`. Empty when the peers are unknown
 * or ranks is NULL. Asks over TCP for at most a few seconds in all. */
void hsdp_who_is_missing(char *out, size_t n, const char *what, const int *ranks, int size);

#endif
