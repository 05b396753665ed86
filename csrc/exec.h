/* exec.h - a worker thread with a FIFO task queue (exec.c), private to the MPI backend. A
 * task is owned by whoever submits it and must stay alive until hsdp_task_wait returns. */
#ifndef HSDP_EXEC_H
#define HSDP_EXEC_H

#include <stdatomic.h>
#include <stdint.h>

#include "hsdp.h"

enum { HSDP_TASK_IDLE = 0, HSDP_TASK_QUEUED = 1, HSDP_TASK_DONE = 2 };

typedef struct hsdp_task {
    hsdp_status (*fn)(void *arg);
    void *arg;
    _Atomic int state;
    hsdp_status status;
    char err[512];   /* the worker's error message, re-raised on the waiting thread */
    uint64_t submit_ns, start_ns, end_ns; /* CLOCK_MONOTONIC, for traces */
    struct hsdp_task *next;
} hsdp_task;

typedef struct hsdp_exec hsdp_exec;

hsdp_status hsdp_exec_start(hsdp_exec **out);
/* Drains the queue and joins the thread; later tasks run inline. ex stays valid. */
void hsdp_exec_stop(hsdp_exec *ex);
/* Stops (if needed) and frees ex. */
void hsdp_exec_free(hsdp_exec *ex);
/* Queues t; with ex NULL or on the worker itself, runs t inline. */
void hsdp_exec_submit(hsdp_exec *ex, hsdp_task *t);
int hsdp_task_done(const hsdp_task *t);
/* Waits for t and returns its status (its message becomes this thread's last error). */
hsdp_status hsdp_task_wait(hsdp_exec *ex, hsdp_task *t);
/* Runs t and waits: on this thread when the worker is idle with an empty queue (holding the
 * queue lock, so calls stay serialised and in order), else queued behind the others. */
hsdp_status hsdp_exec_call(hsdp_exec *ex, hsdp_task *t);
/* hsdp_exec_call with a task of its own. */
hsdp_status hsdp_exec_run(hsdp_exec *ex, hsdp_status (*fn)(void *), void *arg);
int hsdp_exec_on_worker(const hsdp_exec *ex);
/* Whether the worker is started and not stopping. */
int hsdp_exec_running(hsdp_exec *ex);

#endif
