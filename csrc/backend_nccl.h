/* backend_nccl.h - what the NCCL backend needs from its caller before its world can exist.
 * Nothing is linked: libnccl and libcudart are opened at run time by hsdp_nccl_load, from
 * paths the caller chooses (Python passes the copies torch has loaded: a dlopen by soname
 * before torch is imported would pick another NCCL and break torch). The unique id that
 * joins the ranks is made on rank 0 and carried to the others by the caller (an MPI
 * broadcast, or torch's TCPStore), never over a socket of hsdp's own code (its only one is the
 * watchdog's status port, peer_status.h, opened by a world of two or more). */
#ifndef HSDP_BACKEND_NCCL_H
#define HSDP_BACKEND_NCCL_H

#include "hsdp.h"

enum { HSDP_NCCL_ID_BYTES = 128 };

/* 1 when this build has the NCCL backend: every build, unless built with HSDP_NO_NCCL=1 (it needs
 * no CUDA or NCCL header: see cuda_abi.h). */
int hsdp_nccl_built(void);
/* Opens both libraries and resolves every symbol, then checks for a GPU. On any failure
 * nothing stays open and the message says what is missing. Loading twice is a no-op. */
hsdp_status hsdp_nccl_load(const char *nccl_path, const char *cudart_path);
int hsdp_nccl_loaded(void);
/* ncclGetVersion of the loaded library (e.g. 23007 for 2.30.7), or 0 before loading. */
int hsdp_nccl_version(void);
/* ncclGetUniqueId (rank 0 only; the caller sends the bytes to the other ranks). */
hsdp_status hsdp_nccl_unique_id(unsigned char out[HSDP_NCCL_ID_BYTES]);
/* What the next world() joins: the id, this rank, the world size and the CUDA device. */
hsdp_status hsdp_nccl_set_bootstrap(const unsigned char id[HSDP_NCCL_ID_BYTES], int rank, int size, int device);
/* The stream the caller's framework computes on (torch's current stream; NULL: the legacy
 * default stream). Gathers make it wait on their completion, never the host. */
void hsdp_nccl_set_compute_stream(void *stream);
/* Called when a cudaMalloc of the backend's fails for lack of memory, before it retries once:
 * it may free what a framework caches (Python registers torch.cuda.empty_cache). Returns
 * nonzero when it freed something worth a retry. NULL: no retry. */
typedef int (*hsdp_nccl_oom_fn)(void *arg);
void hsdp_nccl_set_oom_handler(hsdp_nccl_oom_fn fn, void *arg);
/* The side stream gathers run on (NULL before the world exists), for timing with events. */
void *hsdp_nccl_comm_stream(void);
/* Compares every unit gather's agreement tickets still queued, waiting for each to land
 * (backend_nccl.c, [Note: tickets checked late]); fails, naming what each rank asked for,
 * when ranks gathered different units (the communicators are then aborted). The end of a
 * sharded forward calls it. HSDP_OK when the NCCL world is not up. */
hsdp_status hsdp_nccl_agreement_drain(void);
/* Its device (CUDA: allocation, DLPack export, streams) is the backend table's device slot. */

#endif
