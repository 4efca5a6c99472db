/* Machine gauges for reading noisy latency runs (see README.md here): a dependent multiply-add
 * loop (the core's speed), pointer chases over 32 KiB and 256 KiB (the caches' latency), and
 * the cost of x86 `pause` and of an uncontended `lock xadd`. One line, space-separated:
 *   mul_ns chase32k_ns chase256k_ns pause_cycles lockxadd_cycles */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <x86intrin.h>

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static double mul_ns(void) {
    volatile uint64_t sink;
    uint64_t x = 1;
    long n = 50000000;
    double t = now_ns();
    for (long i = 0; i < n; i++) x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    t = now_ns() - t;
    sink = x;
    (void)sink;
    return t / n;
}

static double chase_ns(size_t bytes) {
    size_t n = bytes / 64, *a = aligned_alloc(64, n * 64), *perm = malloc(n * sizeof *perm);
    for (size_t i = 0; i < n; i++) perm[i] = i;
    srand(1);
    for (size_t i = n - 1; i > 0; i--) {
        size_t j = rand() % (i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (size_t i = 0; i < n; i++) a[perm[i] * 8] = perm[(i + 1) % n] * 8;
    size_t p = 0;
    for (size_t i = 0; i < n * 4; i++) p = a[p];
    long iters = 5000000;
    double t = now_ns();
    for (long i = 0; i < iters; i++) p = a[p];
    t = now_ns() - t;
    volatile size_t sink = p;
    (void)sink;
    free(a);
    free(perm);
    return t / iters;
}

int main(void) {
    long n = 10000000;
    uint64_t t0 = __rdtsc();
    for (long i = 0; i < n; i++) _mm_pause();
    double pause = (double)(__rdtsc() - t0) / n;
    _Atomic long x = 0;
    t0 = __rdtsc();
    for (long i = 0; i < n; i++) atomic_fetch_add(&x, 1);
    double lock = (double)(__rdtsc() - t0) / n;
    printf("%.3f %.1f %.1f %.1f %.1f\n", mul_ns(), chase_ns(32 << 10), chase_ns(256 << 10), pause, lock);
    return 0;
}
