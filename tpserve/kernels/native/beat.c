/* The liveness link's beats on a native thread (tpserve/ranks/beats.py), out of reach of the GIL.

   One link: a connected TCP socket the thread owns. Every beat_s it sends a beat byte, as long as
   the Python side called beat_wait within stall_after_s (a rank whose interpreter has not run for
   that long stops beating, so its peer still learns of a hang); it reads the peer's bytes and ends
   the link on end of file, a reset, an error, or dead_after_s of silence. A BYE byte from the peer
   is recorded (its close is then no loss). Python learns the end from beat_wait, which blocks with
   the GIL released (ctypes.CDLL) until the link ends or its timeout passes.

   States: BEAT_LIVE, BEAT_ENDED (end of file or reset: the peer's process ended), BEAT_SILENT,
   BEAT_FAILED (beat_error says the errno). Plain C, no Python headers. */

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { BEAT_LIVE = 0, BEAT_ENDED = 1, BEAT_SILENT = 2, BEAT_FAILED = 3 };

static const char BEAT = '.', BYE = 'B';

typedef struct {
    int fd;
    double beat_s, dead_after_s, stall_after_s;
    pthread_mutex_t lock; /* every field below, and every send */
    pthread_cond_t ended_cond;
    double touched; /* when Python last called beat_wait */
    double heard;   /* when the peer's last bytes arrived */
    int state, error, leaving, closing;
    pthread_t thread;
} beat_link;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A lost byte is no harm: a full send buffer means the peer reads nothing, which its own silence
   shows. Called with the lock held. */
static void send_byte(beat_link *link, char byte) {
    (void)send(link->fd, &byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

static void end_link(beat_link *link, int state, int error) {
    pthread_mutex_lock(&link->lock);
    link->state = state;
    link->error = error;
    pthread_cond_broadcast(&link->ended_cond);
    pthread_mutex_unlock(&link->lock);
}

static void *run(void *arg) {
    beat_link *link = arg;
    double next_beat = now_s();
    char data[64];
    for (;;) {
        double now = now_s();
        pthread_mutex_lock(&link->lock);
        int closing = link->closing;
        if (!closing && now >= next_beat) {
            if (now - link->touched < link->stall_after_s) send_byte(link, BEAT);
            next_beat = now + link->beat_s;
        }
        double dead_at = link->heard + link->dead_after_s;
        pthread_mutex_unlock(&link->lock);
        if (closing) {
            end_link(link, BEAT_ENDED, 0);
            return NULL;
        }
        if (now >= dead_at) {
            end_link(link, BEAT_SILENT, 0);
            return NULL;
        }
        double wait_s = (next_beat < dead_at ? next_beat : dead_at) - now;
        struct pollfd ready = {.fd = link->fd, .events = POLLIN};
        int num_ready = poll(&ready, 1, (int)(wait_s * 1000.0) + 1);
        if (num_ready < 0 && errno == EINTR) continue;
        if (num_ready < 0) {
            end_link(link, BEAT_FAILED, errno);
            return NULL;
        }
        if (num_ready == 0) continue;
        ssize_t size = recv(link->fd, data, sizeof data, MSG_DONTWAIT);
        if (size < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
        if (size == 0 || (size < 0 && errno == ECONNRESET)) { /* reset: closed with our beats unread */
            end_link(link, BEAT_ENDED, 0);
            return NULL;
        }
        if (size < 0) {
            end_link(link, BEAT_FAILED, errno);
            return NULL;
        }
        pthread_mutex_lock(&link->lock);
        link->heard = now_s();
        if (memchr(data, BYE, (size_t)size) != NULL) link->leaving = 1;
        pthread_mutex_unlock(&link->lock);
    }
}

/* Takes the socket `fd` (closed by beat_close) and starts beating; NULL if no thread could start. */
beat_link *beat_start(int fd, double beat_s, double dead_after_s, double stall_after_s) {
    beat_link *link = calloc(1, sizeof *link);
    if (link == NULL) return NULL;
    link->fd = fd;
    link->beat_s = beat_s;
    link->dead_after_s = dead_after_s;
    link->stall_after_s = stall_after_s;
    link->touched = link->heard = now_s();
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&link->ended_cond, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&link->lock, NULL);
    if (pthread_create(&link->thread, NULL, run, link) != 0) {
        pthread_cond_destroy(&link->ended_cond);
        pthread_mutex_destroy(&link->lock);
        free(link);
        return NULL;
    }
    return link;
}

/* Python checks in (the beats go on for stall_after_s more); blocks up to timeout_s for the link
   to end. Returns the state. */
int beat_wait(beat_link *link, double timeout_s) {
    pthread_mutex_lock(&link->lock);
    link->touched = now_s();
    double until = link->touched + timeout_s;
    struct timespec deadline = {.tv_sec = (time_t)until};
    deadline.tv_nsec = (long)((until - (double)deadline.tv_sec) * 1e9);
    while (link->state == BEAT_LIVE) {
        if (pthread_cond_timedwait(&link->ended_cond, &link->lock, &deadline) == ETIMEDOUT) break;
    }
    int state = link->state;
    pthread_mutex_unlock(&link->lock);
    return state;
}

double beat_silent_s(beat_link *link) {
    pthread_mutex_lock(&link->lock);
    double silent_s = now_s() - link->heard;
    pthread_mutex_unlock(&link->lock);
    return silent_s;
}

int beat_error(beat_link *link) { return link->error; }

int beat_leaving(beat_link *link) {
    pthread_mutex_lock(&link->lock);
    int leaving = link->leaving;
    pthread_mutex_unlock(&link->lock);
    return leaving;
}

/* Say BYE (if `bye`), stop the thread and close the socket. Idempotent; the link stays readable
   until beat_free. */
void beat_close(beat_link *link, int bye) {
    pthread_mutex_lock(&link->lock);
    int first = !link->closing;
    link->closing = 1;
    if (first && bye && link->state == BEAT_LIVE) send_byte(link, BYE);
    pthread_mutex_unlock(&link->lock);
    if (!first) return;
    shutdown(link->fd, SHUT_RDWR); /* wakes the thread's poll */
    pthread_join(link->thread, NULL);
    close(link->fd);
}

void beat_free(beat_link *link) {
    pthread_cond_destroy(&link->ended_cond);
    pthread_mutex_destroy(&link->lock);
    free(link);
}
