/* exec.c - one worker thread fed by a FIFO queue: the MPI backend's own implementation of
 * its asynchronous slots (backend_mpi.c is its only user). Every MPI call runs on it, so a
 * gather progresses while the Python thread computes, and MPI only ever sees one
 * calling thread at a time (MPI_THREAD_SERIALIZED suffices). FIFO order matters: all ranks
 * of a group must issue their collectives in the same order, and they do, because each
 * rank's calls reach its worker in program order. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "exec.h"

struct hsdp_exec {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work; /* signalled when a task is queued or stop is asked */
    pthread_cond_t done; /* broadcast when a task completes */
    hsdp_task *head, *tail;
    int stop;
    int stopped; /* joined */
    int exited;  /* the worker left its loop (set under mu): later tasks run inline */
    int busy;    /* the worker is running a task */
};

static _Thread_local const hsdp_exec *current_worker; /* set on the worker thread only */

int hsdp_exec_on_worker(const hsdp_exec *ex) { return ex && current_worker == ex; }

static void run_task(hsdp_task *t) {
    t->start_ns = hsdp_now_ns();
    t->status = t->fn(t->arg);
    t->end_ns = hsdp_now_ns();
    if (t->status != HSDP_OK) snprintf(t->err, sizeof t->err, "%s", hsdp_last_error());
}

static void *worker(void *arg) {
    hsdp_exec *ex = arg;
    current_worker = ex;
    pthread_mutex_lock(&ex->mu);
    for (;;) {
        while (!ex->head && !ex->stop) pthread_cond_wait(&ex->work, &ex->mu);
        if (!ex->head) { /* stop asked and the queue is drained */
            ex->exited = 1;
            break;
        }
        hsdp_task *t = ex->head;
        ex->head = t->next;
        if (!ex->head) ex->tail = NULL;
        ex->busy = 1;
        pthread_mutex_unlock(&ex->mu);
        run_task(t);
        pthread_mutex_lock(&ex->mu);
        ex->busy = 0;
        atomic_store(&t->state, HSDP_TASK_DONE);
        pthread_cond_broadcast(&ex->done);
    }
    pthread_mutex_unlock(&ex->mu);
    return NULL;
}

hsdp_status hsdp_exec_start(hsdp_exec **out) {
    hsdp_exec *ex = calloc(1, sizeof *ex); /* owned by the caller; hsdp_exec_free */
    if (!ex) return hsdp_fail(HSDP_ENOMEM, "could not allocate the collective worker");
    pthread_mutex_init(&ex->mu, NULL);
    pthread_cond_init(&ex->work, NULL);
    pthread_cond_init(&ex->done, NULL);
    int rc = pthread_create(&ex->thread, NULL, worker, ex);
    if (rc != 0) {
        pthread_cond_destroy(&ex->done);
        pthread_cond_destroy(&ex->work);
        pthread_mutex_destroy(&ex->mu);
        free(ex);
        return hsdp_fail(HSDP_ECOMM, "could not start the collective worker thread: %s", strerror(rc));
    }
    *out = ex;
    return HSDP_OK;
}

void hsdp_exec_stop(hsdp_exec *ex) {
    if (!ex || ex->stopped) return;
    pthread_mutex_lock(&ex->mu);
    ex->stop = 1;
    pthread_cond_signal(&ex->work);
    pthread_mutex_unlock(&ex->mu);
    pthread_join(ex->thread, NULL);
    ex->stopped = 1;
}

void hsdp_exec_free(hsdp_exec *ex) {
    if (!ex) return;
    hsdp_exec_stop(ex);
    pthread_cond_destroy(&ex->done);
    pthread_cond_destroy(&ex->work);
    pthread_mutex_destroy(&ex->mu);
    free(ex);
}

void hsdp_exec_submit(hsdp_exec *ex, hsdp_task *t) {
    t->next = NULL;
    t->status = HSDP_OK;
    t->err[0] = '\0';
    t->start_ns = t->end_ns = 0;
    t->submit_ns = hsdp_now_ns();
    if (!ex || hsdp_exec_on_worker(ex)) { /* no worker, or on it: run inline */
        run_task(t);
        atomic_store(&t->state, HSDP_TASK_DONE);
        return;
    }
    pthread_mutex_lock(&ex->mu);
    if (ex->exited) { /* the worker will never look at its queue again */
        pthread_mutex_unlock(&ex->mu);
        run_task(t);
        atomic_store(&t->state, HSDP_TASK_DONE);
        return;
    }
    atomic_store(&t->state, HSDP_TASK_QUEUED);
    if (ex->tail)
        ex->tail->next = t;
    else
        ex->head = t;
    ex->tail = t;
    pthread_cond_signal(&ex->work);
    pthread_mutex_unlock(&ex->mu);
}

int hsdp_task_done(const hsdp_task *t) { return atomic_load(&t->state) == HSDP_TASK_DONE; }

hsdp_status hsdp_task_wait(hsdp_exec *ex, hsdp_task *t) {
    if (atomic_load(&t->state) != HSDP_TASK_DONE) {
        pthread_mutex_lock(&ex->mu);
        while (atomic_load(&t->state) != HSDP_TASK_DONE) pthread_cond_wait(&ex->done, &ex->mu);
        pthread_mutex_unlock(&ex->mu);
    }
    atomic_store(&t->state, HSDP_TASK_IDLE);
    if (t->status != HSDP_OK) return hsdp_fail(t->status, "%s", t->err);
    return HSDP_OK;
}

int hsdp_exec_running(hsdp_exec *ex) {
    if (!ex) return 0;
    pthread_mutex_lock(&ex->mu);
    int running = !ex->stop;
    pthread_mutex_unlock(&ex->mu);
    return running;
}

hsdp_status hsdp_exec_call(hsdp_exec *ex, hsdp_task *t) {
    if (ex && !hsdp_exec_on_worker(ex)) {
        pthread_mutex_lock(&ex->mu);
        if (ex->exited || (!ex->head && !ex->busy)) {
            /* Idle worker and empty queue, or no worker any more: run here while holding the lock, so MPI still sees
             * one calling thread at a time and nothing queued can overtake this call. The
             * handoff to the worker costs microseconds a synchronous call need not pay. */
            t->next = NULL;
            t->submit_ns = hsdp_now_ns();
            /* while it runs, this thread is the worker: nested calls run inline too */
            const hsdp_exec *prev = current_worker;
            current_worker = ex;
            run_task(t);
            current_worker = prev;
            atomic_store(&t->state, HSDP_TASK_DONE);
            pthread_mutex_unlock(&ex->mu);
            return hsdp_task_wait(ex, t);
        }
        pthread_mutex_unlock(&ex->mu);
    }
    hsdp_exec_submit(ex, t);
    return hsdp_task_wait(ex, t);
}

hsdp_status hsdp_exec_run(hsdp_exec *ex, hsdp_status (*fn)(void *), void *arg) {
    hsdp_task t = {.fn = fn, .arg = arg};
    return hsdp_exec_call(ex, &t);
}
