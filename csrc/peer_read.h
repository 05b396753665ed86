/* peer_read.h - who a process is, and reading a peer process's memory: backend-neutral
 * helpers of direct gathers (mpi_direct.c) and of the watchdog naming who is missing. */
#ifndef HSDP_PEER_READ_H
#define HSDP_PEER_READ_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* FNV-1a over n bytes, continuing from h (start: 1469598103934665603). */
uint64_t hsdp_fnv1a(uint64_t h, const char *s, size_t n);
/* Which host: ranks on different hosts cannot read each other by pid. */
uint64_t hsdp_host_id(void);
/* Which pid namespace: containers on one host see different pids. */
uint64_t hsdp_pidns_id(void);
/* Reads exactly n bytes at the peer's address (process_vm_readv may stop short): 0 or errno. */
int hsdp_peer_read(pid_t pid, void *dst, uint64_t addr, size_t n);

#endif
