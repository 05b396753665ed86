/* peer_status.c - what this rank waits in, answered over TCP (see peer_status.h). POSIX
 * sockets only: the answer is a few hundred bytes, once, just before a job ends. */
#define _GNU_SOURCE /* getifaddrs' flags, getrandom */
#include "peer_status.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { ANSWER_MAX = 384, POLL_MS = 200, SERVE_IO_MS = 500 };

static int listen_fd = -1;        /* owned: open while the thread serves */
static uint64_t my_cookie;
static hsdp_status_describe describe_fn;
static pthread_t serve_thread;
static atomic_int serving, stop_serving;

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Reads up to n bytes until EOF or the deadline (ms on now_ms's clock): how many. */
static size_t read_until(int fd, void *buf, size_t n, int64_t deadline) {
    size_t got = 0;
    while (got < n) {
        int left = (int)(deadline - now_ms());
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (left <= 0) break;
        int ready = poll(&p, 1, left);
        if (ready < 0 && errno == EINTR) continue;
        if (ready <= 0) break;
        ssize_t r = recv(fd, (char *)buf + got, n - got, MSG_DONTWAIT);
        if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    return got;
}

static void answer(int fd) {
    struct timeval send_limit = {0, SERVE_IO_MS * 1000}; /* reads poll; the reply's send is bounded here */
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_limit, sizeof send_limit);
    uint64_t cookie = 0;
    if (read_until(fd, &cookie, sizeof cookie, now_ms() + SERVE_IO_MS) != sizeof cookie || cookie != my_cookie)
        return; /* not the job's */
    char reply[ANSWER_MAX];
    reply[0] = describe_fn(reply + 1, sizeof reply - 1) ? 'A' : 'I'; /* active, idle */
    size_t len = 1 + strnlen(reply + 1, sizeof reply - 1);
    for (size_t sent = 0; sent < len;) {
        ssize_t w = send(fd, reply + sent, len - sent, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return;
        sent += (size_t)w;
    }
}

static void *serve(void *arg) {
    (void)arg;
    while (!atomic_load(&stop_serving)) {
        struct pollfd p = {.fd = listen_fd, .events = POLLIN};
        if (poll(&p, 1, POLL_MS) <= 0) continue;
        /* The listening socket is non-blocking: a connection gone before accept must not
         * block this thread, which hsdp_status_stop joins. The accepted one blocks. */
        int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        answer(fd);
        close(fd);
    }
    return NULL;
}

/* This host's IPv4 addresses, not loopback first, loopback last (peers in other network
 * namespaces of one host reach neither, peers in the same one reach both). */
static void local_addrs(uint64_t *out) {
    int k = 0;
    struct ifaddrs *all = NULL;
    if (getifaddrs(&all) == 0) {
        for (struct ifaddrs *i = all; i && k < HSDP_STATUS_ADDRS - 1; i = i->ifa_next) {
            if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP) ||
                (i->ifa_flags & IFF_LOOPBACK))
                continue;
            out[k++] = ntohl(((const struct sockaddr_in *)(const void *)i->ifa_addr)->sin_addr.s_addr);
        }
        freeifaddrs(all);
    }
    out[k] = INADDR_LOOPBACK;
}

/* The card of the socket being served. */
static void fill_card(hsdp_status_card *card) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    if (getsockname(listen_fd, (struct sockaddr *)&a, &len) != 0) return;
    card->cookie = my_cookie;
    card->port = ntohs(a.sin_port);
    local_addrs(card->addr);
}

void hsdp_status_serve(hsdp_status_describe describe, hsdp_status_card *card) {
    memset(card, 0, sizeof *card);
    if (atomic_load(&serving)) {
        fill_card(card);
        return;
    }
    uint64_t cookie = 0;
    if (getrandom(&cookie, sizeof cookie, 0) != (ssize_t)sizeof cookie || !cookie) return;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY), .sin_port = 0};
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, SOMAXCONN) != 0) {
        close(fd);
        return;
    }
    listen_fd = fd;
    my_cookie = cookie;
    describe_fn = describe;
    atomic_store(&stop_serving, 0);
    /* Signals are the application's: the answering thread takes none of them. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int made = pthread_create(&serve_thread, NULL, serve, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (made != 0) {
        close(fd);
        listen_fd = -1;
        return;
    }
    atomic_store(&serving, 1);
    fill_card(card);
}

void hsdp_status_stop(void) {
    if (!atomic_load(&serving)) return;
    atomic_store(&stop_serving, 1);
    pthread_join(serve_thread, NULL);
    close(listen_fd);
    listen_fd = -1;
    atomic_store(&serving, 0);
}

/* A connected (non-blocking) socket to addr:port within ms, or -1. */
static int connect_within(uint32_t addr, uint16_t port, int ms) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(addr), .sin_port = htons(port)};
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int err = 0;
        socklen_t len = sizeof err;
        if (errno != EINPROGRESS || poll(&p, 1, ms) != 1 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 ||
            err != 0) {
            close(fd);
            return -1;
        }
    }
    return fd; /* still non-blocking: the reads poll against the deadline */
}

int hsdp_status_ask(const hsdp_status_card *peer, int timeout_ms, int *active, char *what, size_t n) {
    if (!peer->cookie || !peer->port || peer->port > 65535 || n == 0) return 0;
    int naddr = 0;
    while (naddr < HSDP_STATUS_ADDRS && peer->addr[naddr]) naddr++;
    int64_t deadline = now_ms() + timeout_ms;
    for (int i = 0; i < naddr; i++) {
        /* each address its share of what is left: one that drops SYNs cannot take it all */
        int64_t now = now_ms(), until = now + (deadline - now) / (naddr - i);
        if (until <= now) break;
        int fd = connect_within((uint32_t)peer->addr[i], (uint16_t)peer->port, (int)(until - now));
        if (fd < 0) continue;
        char reply[ANSWER_MAX];
        size_t got = 0;
        if (send(fd, &peer->cookie, sizeof peer->cookie, MSG_NOSIGNAL | MSG_DONTWAIT) == (ssize_t)sizeof peer->cookie)
            got = read_until(fd, reply, sizeof reply - 1, until);
        close(fd);
        if (got == 0 || (reply[0] != 'A' && reply[0] != 'I')) continue; /* someone else's port */
        reply[got] = '\0';
        *active = reply[0] == 'A';
        snprintf(what, n, "%s", reply + 1);
        return 1;
    }
    return 0;
}
