/* hpcdl's communication thread in C: the hand-off of a small collective to the one thread that calls the
 * library, without the interpreter on either side of it.
 *
 * hpcdl/distributed/native/c_comm_thread.py builds this file with the C compiler (one object, no Python or torch headers)
 * and loads it with ctypes, which releases the interpreter lock for the length of each call. A caller queues a
 * call of a library function (a pointer the library's loader resolved: onecclAllReduce...) with its arguments
 * and gets a ticket; it waits for the ticket with a bound, and gets the function's return code. The thread runs
 * the queued calls in ticket order. Each side spins a while before it sleeps: a collective answered in
 * microseconds costs no wake-up on a core that has time to spare.
 *
 * Nothing here knows a library: the caller gives the function and up to eight integer or pointer arguments,
 * and says how many the function takes (0 to 8). A function of none may be a ctypes callback: the group's
 * rare calls (a communicator's creation and destruction) run Python here, so that one thread makes every call
 * of the library, as it did before this file existed.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define FC_ABORTED (-((intptr_t)1 << 62)) /* c_comm_thread.py: ABORTED */
#define SLOTS 256 /* calls queued at most; past that fc_submit refuses and the caller takes another path */

#define I intptr_t
typedef I (*fn0_t)(void);
typedef I (*fn1_t)(I);
typedef I (*fn2_t)(I, I);
typedef I (*fn3_t)(I, I, I);
typedef I (*fn4_t)(I, I, I, I);
typedef I (*fn5_t)(I, I, I, I, I);
typedef I (*fn6_t)(I, I, I, I, I, I);
typedef I (*fn7_t)(I, I, I, I, I, I, I);
typedef I (*fn8_t)(I, I, I, I, I, I, I, I);
#undef I

typedef struct {
    uint64_t ticket; /* the call this slot holds (queued while ``finished`` has not passed it) */
    int nargs;
    void *fn;
    intptr_t args[8];
    intptr_t rc;
} slot_t;

typedef struct {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t work; /* the thread sleeps on it */
    pthread_cond_t done; /* waiters sleep on it */
    slot_t slots[SLOTS];
    uint64_t issued;    /* tickets handed out: written under lock, read atomically */
    uint64_t finished;  /* tickets run to the end, so the next one the thread runs: atomic */
    intptr_t first_error; /* the first nonzero return code, for a caller whose slot was reused since */
    int64_t elsewhere;  /* calls queued on the Python thread and not yet finished there: under lock */
    int thread_sleeps;  /* under lock */
    int waiters_sleep;  /* under lock */
    int stop; /* atomic */
    long spin_ns;
} fc_t;

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static fc_t fc; /* one per process: the library is called from one thread */
static int fc_up;

static intptr_t run(slot_t *s) {
    intptr_t *a = s->args;
    switch (s->nargs) {
    case 0: return ((fn0_t)s->fn)();
    case 1: return ((fn1_t)s->fn)(a[0]);
    case 2: return ((fn2_t)s->fn)(a[0], a[1]);
    case 3: return ((fn3_t)s->fn)(a[0], a[1], a[2]);
    case 4: return ((fn4_t)s->fn)(a[0], a[1], a[2], a[3]);
    case 5: return ((fn5_t)s->fn)(a[0], a[1], a[2], a[3], a[4]);
    case 6: return ((fn6_t)s->fn)(a[0], a[1], a[2], a[3], a[4], a[5]);
    case 7: return ((fn7_t)s->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6]);
    default: return ((fn8_t)s->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
    }
}

static void *serve(void *unused) {
    (void)unused;
    for (;;) {
        uint64_t t = __atomic_load_n(&fc.finished, __ATOMIC_RELAXED);
        slot_t *s = &fc.slots[t % SLOTS];
        long until = now_ns() + fc.spin_ns;
        while (__atomic_load_n(&fc.issued, __ATOMIC_ACQUIRE) == t) {
            if (__atomic_load_n(&fc.stop, __ATOMIC_RELAXED))
                return NULL;
            if (now_ns() < until) {
                sched_yield();
                continue;
            }
            pthread_mutex_lock(&fc.lock);
            fc.thread_sleeps = 1;
            while (__atomic_load_n(&fc.issued, __ATOMIC_ACQUIRE) == t && !fc.stop)
                pthread_cond_wait(&fc.work, &fc.lock);
            fc.thread_sleeps = 0;
            pthread_mutex_unlock(&fc.lock);
        }
        s->rc = run(s);
        if (s->rc && !fc.first_error)
            fc.first_error = s->rc;
        __atomic_store_n(&fc.finished, t + 1, __ATOMIC_RELEASE);
        pthread_mutex_lock(&fc.lock);
        if (fc.waiters_sleep)
            pthread_cond_broadcast(&fc.done);
        pthread_mutex_unlock(&fc.lock);
    }
}

/* Start the thread; spin_us: how long each side polls before it sleeps. 0 when started, else errno. */
int fc_start(long spin_us) {
    if (fc_up)
        return 0;
    memset(&fc, 0, sizeof fc);
    pthread_mutex_init(&fc.lock, NULL);
    pthread_cond_init(&fc.work, NULL);
    pthread_cond_init(&fc.done, NULL);
    fc.spin_ns = spin_us * 1000L;
    int rc = pthread_create(&fc.thread, NULL, serve, NULL);
    if (rc == 0)
        fc_up = 1;
    return rc;
}

/* Queue the call; the caller holds fc.lock. The ticket, or -1 when SLOTS calls are queued already. */
static int64_t enqueue(void *fn, int nargs, const intptr_t *a) {
    uint64_t t = __atomic_load_n(&fc.issued, __ATOMIC_RELAXED);
    if (t - __atomic_load_n(&fc.finished, __ATOMIC_ACQUIRE) >= SLOTS)
        return -1;
    slot_t *s = &fc.slots[t % SLOTS];
    s->ticket = t;
    s->fn = fn;
    s->nargs = nargs;
    memcpy(s->args, a, sizeof s->args);
    __atomic_store_n(&fc.issued, t + 1, __ATOMIC_RELEASE);
    if (fc.thread_sleeps)
        pthread_cond_signal(&fc.work);
    return (int64_t)t;
}

/* Queue fn(args[0..nargs-1]); the ticket to wait for, or -1 when SLOTS calls are queued already. */
int64_t fc_submit(void *fn, int nargs, intptr_t a0, intptr_t a1, intptr_t a2, intptr_t a3, intptr_t a4,
                  intptr_t a5, intptr_t a6, intptr_t a7) {
    intptr_t a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    pthread_mutex_lock(&fc.lock);
    int64_t t = enqueue(fn, nargs, a);
    pthread_mutex_unlock(&fc.lock);
    return t;
}

/* Wait at most timeout_ms for ticket t: 1 done (its return code in *rc), 0 not yet. */
int fc_wait(int64_t t, long timeout_ms, intptr_t *rc) {
    slot_t *s = &fc.slots[t % SLOTS];
    uint64_t u = (uint64_t)t;
    long start = now_ns(), until_spin = start + fc.spin_ns, until = start + timeout_ms * 1000000L;
    while (__atomic_load_n(&fc.finished, __ATOMIC_ACQUIRE) <= u) {
        long now = now_ns();
        if (now < until_spin) {
            sched_yield();
            continue;
        }
        if (now >= until)
            return 0;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long ns = ts.tv_nsec + (until - now);
        ts.tv_sec += ns / 1000000000L;
        ts.tv_nsec = ns % 1000000000L;
        pthread_mutex_lock(&fc.lock);
        fc.waiters_sleep++;
        if (__atomic_load_n(&fc.finished, __ATOMIC_ACQUIRE) <= u)
            pthread_cond_timedwait(&fc.done, &fc.lock, &ts);
        fc.waiters_sleep--;
        pthread_mutex_unlock(&fc.lock);
    }
    intptr_t got = s->rc;
    /* read the slot, then check that no later call took it meanwhile (SLOTS calls queued since) */
    *rc = __atomic_load_n(&s->ticket, __ATOMIC_ACQUIRE) == u ? got : fc.first_error;
    return 1;
}

/* Tickets issued and not yet run to the end (queued or running). */
int64_t fc_pending(void) {
    return (int64_t)(__atomic_load_n(&fc.issued, __ATOMIC_ACQUIRE) - __atomic_load_n(&fc.finished, __ATOMIC_ACQUIRE));
}

/* Ask the thread to end once nothing is queued (a thread inside a call stays there). */
void fc_stop(void) {
    pthread_mutex_lock(&fc.lock);
    fc.stop = 1;
    pthread_cond_signal(&fc.work);
    pthread_mutex_unlock(&fc.lock);
}

/* Whether the calling thread is the communication thread (a SIGABRT handler asks). */
int fc_is_current(void) {
    return fc_up && pthread_equal(pthread_self(), fc.thread);
}

/* On the communication thread, in place of a library call that cannot return (a SIGABRT inside it): finish the
 * call in progress with FC_ABORTED and block for good, as a call that never returns would. */
void fc_park(void) {
    uint64_t t = __atomic_load_n(&fc.finished, __ATOMIC_RELAXED);
    slot_t *s = &fc.slots[t % SLOTS];
    s->rc = FC_ABORTED;
    if (!fc.first_error)
        fc.first_error = FC_ABORTED;
    __atomic_store_n(&fc.finished, t + 1, __ATOMIC_RELEASE);
    pthread_mutex_lock(&fc.lock);
    pthread_cond_broadcast(&fc.done);
    pthread_mutex_unlock(&fc.lock);
    for (;;)
        pause();
}

/* Whether ticket t has finished. */
int fc_done(int64_t t) {
    return __atomic_load_n(&fc.finished, __ATOMIC_ACQUIRE) > (uint64_t)t;
}

/* The Python thread's queue, counted here so that a caller in C++ and one in Python agree on it: +1 when a call
 * is queued there, -1 when it has finished. */
void fc_elsewhere(int delta) {
    pthread_mutex_lock(&fc.lock);
    fc.elsewhere += delta;
    pthread_mutex_unlock(&fc.lock);
}

/* fc_submit, but only while nothing is queued on the Python thread (else -1: the caller queues it there, behind
 * the others, so that collectives reach the library in issue order). */
int64_t fc_submit_if_idle(void *fn, int nargs, intptr_t a0, intptr_t a1, intptr_t a2, intptr_t a3, intptr_t a4,
                          intptr_t a5, intptr_t a6, intptr_t a7) {
    intptr_t a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    pthread_mutex_lock(&fc.lock);
    int64_t t = fc.elsewhere == 0 ? enqueue(fn, nargs, a) : -1;
    pthread_mutex_unlock(&fc.lock);
    return t;
}

/* Wait at most timeout_ms for every call issued so far: 1 when none is left. */
int fc_drain(long timeout_ms) {
    uint64_t last = __atomic_load_n(&fc.issued, __ATOMIC_ACQUIRE);
    intptr_t rc;
    return last == 0 || fc_wait((int64_t)last - 1, timeout_ms, &rc);
}

/* Tickets issued so far. */
int64_t fc_issued(void) {
    return (int64_t)__atomic_load_n(&fc.issued, __ATOMIC_ACQUIRE);
}
