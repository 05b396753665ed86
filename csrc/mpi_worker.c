/* mpi_worker.c - every MPI call runs on one worker thread (exec.c); the asynchronous slots
 * are tasks queued there (mpi_internal.h). */
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

hsdp_exec *hsdp_mpi_worker;

/* ---------------------------------------------------------------- on the worker */
/* Every call is queued on the worker (or run on this thread while the worker is idle with an
 * empty queue, holding its lock: see hsdp_exec_call), so MPI sees one calling thread at a
 * time and calls keep program order, which collectives across ranks require. */
typedef struct {
    hsdp_group *g;
    const void *send;
    void *recv;
    size_t nbytes;
    int root, color, key;
    hsdp_group **out;
    void **share;
    const char *label;
    uint64_t ident;
    const hsdp_blocks *sblocks, *rblocks;
    size_t rbytes;
    int dest, source;
} call_args;

static hsdp_status do_all_gather(void *p) {
    call_args *a = p;
    return hsdp_mpi_raw_all_gather(a->g, a->send, a->recv, a->nbytes);
}
static hsdp_status do_gather_fixed(void *p) {
    call_args *a = p;
    return hsdp_mpi_fixed_gather(a->g, a->share, a->send, a->recv, a->nbytes, a->label, a->ident, NULL);
}
static hsdp_status do_broadcast(void *p) {
    call_args *a = p;
    return hsdp_mpi_raw_broadcast(a->g, a->recv, a->nbytes, a->root);
}
static hsdp_status do_barrier(void *p) {
    call_args *a = p;
    return hsdp_mpi_raw_barrier(a->g);
}
static hsdp_status do_all_to_all(void *p) {
    call_args *a = p;
    return hsdp_mpi_raw_all_to_all(a->g, a->send, a->recv, a->nbytes);
}

static hsdp_status do_all_to_all_blocks(void *p) {
    call_args *a = p;
    return hsdp_mpi_raw_all_to_all_blocks(a->g, a->send, a->sblocks, a->recv, a->rblocks);
}
static hsdp_status do_sendrecv(void *p) {
    call_args *a = p;
    return hsdp_mpi_raw_sendrecv(a->g, a->send, a->nbytes, a->dest, a->recv, a->rbytes, a->source);
}
static hsdp_status do_split(void *p) {
    call_args *a = p;
    return hsdp_mpi_raw_split(a->g, a->color, a->key, a->out);
}
static hsdp_status do_free(void *p) {
    hsdp_mpi_raw_free(p);
    return HSDP_OK;
}

hsdp_status hsdp_mpi_all_gather(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    call_args a = {.g = g, .send = send, .recv = recv, .nbytes = nbytes};
    return hsdp_exec_run(hsdp_mpi_worker, do_all_gather, &a);
}
hsdp_status hsdp_mpi_gather_unit(hsdp_group *g, void **share, const void *send, void *recv, size_t nbytes,
                                   const char *label, uint64_t ident) {
    call_args a = {.g = g, .send = send, .recv = recv, .nbytes = nbytes, .share = share, .label = label,
                   .ident = ident};
    return hsdp_exec_run(hsdp_mpi_worker, do_gather_fixed, &a);
}
hsdp_status hsdp_mpi_broadcast(hsdp_group *g, void *buf, size_t nbytes, int root) {
    call_args a = {.g = g, .recv = buf, .nbytes = nbytes, .root = root};
    return hsdp_exec_run(hsdp_mpi_worker, do_broadcast, &a);
}
hsdp_status hsdp_mpi_barrier(hsdp_group *g) {
    call_args a = {.g = g};
    return hsdp_exec_run(hsdp_mpi_worker, do_barrier, &a);
}
hsdp_status hsdp_mpi_all_to_all(hsdp_group *g, const void *send, void *recv, size_t nbytes) {
    call_args a = {.g = g, .send = send, .recv = recv, .nbytes = nbytes};
    return hsdp_exec_run(hsdp_mpi_worker, do_all_to_all, &a);
}

hsdp_status hsdp_mpi_all_to_all_blocks(hsdp_group *g, const void *send, const hsdp_blocks *sb, void *recv,
                                         const hsdp_blocks *rb) {
    call_args a = {.g = g, .send = send, .recv = recv, .sblocks = sb, .rblocks = rb};
    return hsdp_exec_run(hsdp_mpi_worker, do_all_to_all_blocks, &a);
}
hsdp_status hsdp_mpi_sendrecv(hsdp_group *g, const void *send, size_t sbytes, int dest, void *recv, size_t rbytes,
                                int source) {
    call_args a = {.g = g, .send = send, .nbytes = sbytes, .dest = dest, .recv = recv, .rbytes = rbytes,
                   .source = source};
    return hsdp_exec_run(hsdp_mpi_worker, do_sendrecv, &a);
}
hsdp_status hsdp_mpi_split(hsdp_group *g, int color, int key, hsdp_group **out) {
    call_args a = {.g = g, .color = color, .key = key, .out = out};
    return hsdp_exec_run(hsdp_mpi_worker, do_split, &a);
}
void hsdp_mpi_free(hsdp_group *g) { (void)hsdp_exec_run(hsdp_mpi_worker, do_free, g); }

/* ---------------------------------------------------------------- asynchronous slots */
/* A started gather: a worker task, kept in the request's backend state. */
typedef struct {
    hsdp_task task;
    hsdp_req *r;
    const void *send;
    void *recv;
    size_t nbytes;
} gather_task;
_Static_assert(sizeof(gather_task) <= HSDP_REQ_STATE_BYTES, "HSDP_REQ_STATE_BYTES must hold an MPI gather task");

static hsdp_status gather_job(void *p) {
    gather_task *t = p;
    hsdp_group *g = t->r->g;
    void **share = t->r->share;
    /* A NumPy unit's direct gather widens each chunk as it reads it (hsdp_mpi_direct_widen). */
    hsdp_gather_req *wr = share && hsdp_share_is_direct(g, *share) ? hsdp_unit_widen_request(t->r) : NULL;
    hsdp_status st = wr      ? hsdp_mpi_direct_widen(g, *share, t->send, t->nbytes, wr)
                     : share ? hsdp_mpi_fixed_gather(g, share, t->send, t->recv, t->nbytes, t->r->label, t->r->ident,
                                                     hsdp_unit_landing_request(t->r))
                             : hsdp_mpi_raw_all_gather(g, t->send, t->recv, t->nbytes);
    if (st == HSDP_OK && t->r->then) st = t->r->then(t->r->then_arg);
    return st;
}

hsdp_status hsdp_mpi_gather_start(hsdp_req *r, const void *send, void *recv, size_t nbytes) {
    gather_task *t = (gather_task *)(void *)r->state;
    *t = (gather_task){.task = {.fn = gather_job, .arg = t}, .r = r, .send = send, .recv = recv, .nbytes = nbytes};
    if (r->now) { /* waited at once: on this thread while the worker is idle, as a synchronous call */
        (void)hsdp_exec_call(hsdp_mpi_worker, &t->task);
        atomic_store(&t->task.state, HSDP_TASK_DONE); /* its status is hsdp_mpi_gather_wait's to read */
        return HSDP_OK;
    }
    /* With a worker this only queues; without one (thread level below SERIALIZED) it runs
     * here before returning. */
    hsdp_exec_submit(hsdp_mpi_worker, &t->task);
    return HSDP_OK;
}

/* A started sendrecv: a worker task too, waited by hsdp_mpi_gather_wait (its task comes first). */
typedef struct {
    hsdp_task task;
    hsdp_req *r;
    call_args a;
} sendrecv_task;
_Static_assert(sizeof(sendrecv_task) <= HSDP_REQ_STATE_BYTES, "HSDP_REQ_STATE_BYTES must hold an MPI sendrecv task");
_Static_assert(offsetof(sendrecv_task, task) == 0 && offsetof(gather_task, task) == 0,
               "mpi_gather_wait finds either request's task at the start of its state");

hsdp_status hsdp_mpi_sendrecv_start(hsdp_req *r, const void *send, size_t sbytes, int dest, void *recv,
                                      size_t rbytes, int source) {
    sendrecv_task *t = (sendrecv_task *)(void *)r->state;
    *t = (sendrecv_task){.r = r,
                         .a = {.g = r->g, .send = send, .nbytes = sbytes, .dest = dest, .recv = recv,
                               .rbytes = rbytes, .source = source}};
    t->task = (hsdp_task){.fn = do_sendrecv, .arg = &t->a};
    hsdp_exec_submit(hsdp_mpi_worker, &t->task); /* without a worker: runs here */
    return HSDP_OK;
}

/* Waits a started gather or sendrecv: either keeps its worker task first in r->state. */
void hsdp_mpi_gather_wait(hsdp_req *r) {
    hsdp_task *task = (hsdp_task *)(void *)r->state;
    r->status = hsdp_task_wait(hsdp_mpi_worker, task);
    if (r->status != HSDP_OK) snprintf(r->err, sizeof r->err, "%s", task->err);
    r->submit_ns = task->submit_ns;
    r->start_ns = task->start_ns;
    r->end_ns = task->end_ns;
}

/* False again once MPI is finalised (the worker is stopped). */
int hsdp_mpi_overlaps(const hsdp_group *g) {
    (void)g;
    return hsdp_exec_running(hsdp_mpi_worker);
}
#endif
