// A ping-pong between two pinned threads through rings of 16 receive buffers, as the shm
// provider's Send moves bytes: the sender copies N bytes into the receiver's next buffer and
// then publishes a flag; the receiver spins on the flag, then reads the bytes or not.
// Prints the round trip's median. Shows what moving bytes between the two cores costs by
// itself, whatever the sender does to place them:
//   sender 0: plain copy, 1: copy then cldemote every line, 2: cldemote the first 4 lines,
//          3: non-temporal stores
//   read   0: the receiver reads 1 byte (as the raw ping-pong), 1: it copies all N bytes out
// Build and run (see bench-results/NOTES.md):
//   gcc -O2 -mavx2 -mcldemote -o /tmp/pingpong scripts/cross-core/pingpong.c -lpthread
//   for s in 0 1 2 3; do for r in 0 1; do /tmp/pingpong 4096 $s $r; done; done
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RING 16
#define ITERS 200000
#define MAXN (1 << 16)

static size_t n;
static int sender_mode, reads;
static char *to_srv[RING], *to_cli[RING];
static volatile uint64_t flag_srv __attribute__((aligned(64)));
static volatile uint64_t flag_cli __attribute__((aligned(64)));
static char src_srv[MAXN] __attribute__((aligned(64))), src_cli[MAXN] __attribute__((aligned(64)));
static char *out_srv, *out_cli;

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof s, &s);
}

static void nt_copy(char *d, const char *s, size_t len) {
    size_t i = 0;
    for (; i + 32 <= len; i += 32)
        _mm256_stream_si256((__m256i *)(d + i), _mm256_load_si256((const __m256i *)(s + i)));
    if (i < len) memcpy(d + i, s + i, len - i);
    _mm_sfence();
}

static void put(char *dst, const char *src, volatile uint64_t *flag, uint64_t v) {
    if (sender_mode == 3) nt_copy(dst, src, n); else memcpy(dst, src, n);
    if (sender_mode == 1) for (size_t i = 0; i < n; i += 64) _cldemote(dst + i);
    if (sender_mode == 2) for (size_t i = 0; i < n && i < 256; i += 64) _cldemote(dst + i);
    __atomic_store_n(flag, v, __ATOMIC_RELEASE);
    _cldemote((void *)flag);
}

static void get(const char *buf, char *out, volatile uint64_t *flag, uint64_t v) {
    while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) != v) {}
    if (reads) memcpy(out, buf, n);
    else { volatile char c = buf[0]; (void)c; }
}

static void *server(void *arg) {
    (void)arg;
    pin(1);
    for (uint64_t i = 1; i <= ITERS; i++) {
        get(to_srv[i % RING], out_srv, &flag_srv, i);
        put(to_cli[i % RING], src_srv, &flag_cli, i);
    }
    return 0;
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: pingpong BYTES SENDER_MODE READS\n"); return 2; }
    n = strtoul(argv[1], 0, 10);
    sender_mode = atoi(argv[2]);
    reads = atoi(argv[3]);
    if (n > MAXN) { fprintf(stderr, "at most %d bytes\n", MAXN); return 2; }
    for (int i = 0; i < RING; i++) {
        to_srv[i] = aligned_alloc(4096, MAXN);
        to_cli[i] = aligned_alloc(4096, MAXN);
        memset(to_srv[i], 0, MAXN);
        memset(to_cli[i], 0, MAXN);
    }
    out_srv = aligned_alloc(64, MAXN);
    out_cli = aligned_alloc(64, MAXN);
    memset(out_srv, 0, MAXN);
    memset(out_cli, 0, MAXN);
    pthread_t t;
    pthread_create(&t, 0, server, 0);
    pin(0);
    static double lat[ITERS];
    for (uint64_t i = 1; i <= ITERS; i++) {
        double s = now_ns();
        put(to_srv[i % RING], src_cli, &flag_srv, i);
        get(to_cli[i % RING], out_cli, &flag_cli, i);
        lat[i - 1] = now_ns() - s;
    }
    pthread_join(t, 0);
    qsort(lat, ITERS, sizeof lat[0], cmp);
    printf("bytes %zu sender %d reads %d: round trip p50 %.0f ns\n", n, sender_mode, reads, lat[ITERS / 2]);
    return 0;
}
