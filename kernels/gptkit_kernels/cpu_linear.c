/* y[M, N] = x[M, K] @ W^T (+ bias) in fp32 for the few rows a decode step feeds a layer, on one CPU core or
 * several (OpenMP, torch's own runtime): gptkit_kernels/cpu_linear.py compiles this file once per machine.
 *
 * W is packed as wp[ceil(N / 16)][K][16] (16 outputs side by side for each input; the last block padded with
 * zeros), so a block of 16 outputs is one contiguous stream of K * 64 bytes, read once for up to 16 rows of x
 * held in registers: 16 fused multiply-adds for every 64-byte line of weights. The next lines are prefetched
 * PREFETCH bytes (4 KB) ahead, so the weight stream from memory overlaps the arithmetic (oneDNN's and MKL's
 * kernels for 1-16 rows did not: their time was the memory time plus the arithmetic time, docs/serve.md).
 *
 * gptkit_cpu_linear_i8 takes int8 weights packed the same way (wq[ceil(N / 16)][K][16], a quarter of the
 * bytes to stream) and one fp32 scale an output: each 16 int8 values are widened to fp32 in registers, the
 * sums are the same, and the output is sum * scale + bias (quantize=int8's layer on fp32 inputs).
 *
 * Written with GCC's vector extensions (a 16-float vector, one AVX-512 register); compiled with -mavx512f.
 * Each output is the bias plus the sums of fused multiply-adds over chunks of CHUNK inputs, added up.
 */
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

/* bytes ahead of the weight line being read */
#ifndef PREFETCH
#define PREFETCH 4096
#endif

#ifndef CHUNK
#define CHUNK 64
#endif

#define INLINE static inline __attribute__((always_inline))

/* rows [0, MR) of x against blocks [nb0, nb1) of wp; NB blocks at a time. The sum over k runs in chunks of
 * CHUNK inputs, each chunk's partial sums added to the running total: rounding errors grow with
 * CHUNK + K / CHUNK terms instead of K (F.linear's size of error; one chain of K terms had 5x it at K = 512) */
INLINE void tile(const float *restrict x, long K, const void *restrict wp, const float *restrict scale,
                 const float *restrict bias, float *restrict y, long N, long nb0, long nb1, const int MR,
                 const int NB, const int I8) {
    for (long nb = nb0; nb < nb1; nb += NB) {
        v16 total[16][2];
        for (int j = 0; j < NB; j++) {
            v16 b = {0};
            if (bias && !I8) b = *(const v16 *)(bias + (nb + j) * 16);
            for (int m = 0; m < MR; m++) total[m][j] = b;
        }
        const float *w0 = (const float *)wp + nb * K * 16;
        const signed char *q0 = (const signed char *)wp + nb * K * 16;
        for (long k0 = 0; k0 < K; k0 += CHUNK) {
            long k1 = k0 + CHUNK < K ? k0 + CHUNK : K;
            v16 acc[16][2];
            for (int j = 0; j < NB; j++)
                for (int m = 0; m < MR; m++) acc[m][j] = (v16){0};
            for (long k = k0; k < k1; k++) {
                v16 w[2];
                for (int j = 0; j < NB; j++) {
                    if (I8) {
                        const signed char *p = q0 + j * K * 16 + k * 16;
                        __builtin_prefetch(p + PREFETCH, 0, 3);
                        /* 16 int8 -> 16 int32 -> 16 fp32 (vpmovsxbd, vcvtdq2ps) */
                        __m128i q = _mm_load_si128((const __m128i *)p);
                        w[j] = (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
                    } else {
                        const float *p = w0 + j * K * 16 + k * 16;
                        __builtin_prefetch((const char *)p + PREFETCH, 0, 3);
                        w[j] = *(const v16 *)p;
                    }
                }
                for (int m = 0; m < MR; m++) {
                    float xs = x[m * K + k];
                    for (int j = 0; j < NB; j++) acc[m][j] += xs * w[j];
                }
            }
            for (int j = 0; j < NB; j++)
                for (int m = 0; m < MR; m++) total[m][j] += acc[m][j];
        }
        for (int j = 0; j < NB && I8; j++) {
            v16 s = *(const v16 *)(scale + (nb + j) * 16), b = {0};
            if (bias) b = *(const v16 *)(bias + (nb + j) * 16);
            for (int m = 0; m < MR; m++) total[m][j] = total[m][j] * s + b;
        }
        for (int j = 0; j < NB; j++) {
            long n0 = (nb + j) * 16;
            /* the padded last block: its first N - n0 outputs */
            size_t bytes = n0 + 16 <= N ? 64 : (size_t)(N - n0) * 4;
            for (int m = 0; m < MR; m++) memcpy(y + m * N + n0, &total[m][j], bytes);
        }
    }
}

#define ROWS(R)                                                                    \
    case R:                                                                        \
        if (R <= 8 && b1 - b0 == 2)                                                \
            tile(xr, K, wp, scale, bias, yr, N, b0, b1, R, 2, I8);                 \
        else                                                                       \
            tile(xr, K, wp, scale, bias, yr, N, b0, b1, R, 1, I8);                 \
        break;

/* blocks [nb0, nb1) for every row: two blocks at a time, each pair against every 16 rows of x in turn (the
 * pair's weights stay in cache after the first 16) */
INLINE void blocks(const float *x, const void *wp, const float *scale, const float *bias, float *y, long M,
                   long K, long N, long nb0, long nb1, const int I8) {
    for (long b0 = nb0; b0 < nb1; b0 += 2) {
        long b1 = b0 + 2 < nb1 ? b0 + 2 : nb1;
        for (long m0 = 0; m0 < M; m0 += 16) {
            long r = M - m0 < 16 ? M - m0 : 16;
            const float *xr = x + m0 * K;
            float *yr = y + m0 * N;
            switch (r) {
                ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
                ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
            }
        }
    }
}

static void blocks_f32(const float *x, const void *wp, const float *scale, const float *bias, float *y,
                       long M, long K, long N, long nb0, long nb1) {
    blocks(x, wp, scale, bias, y, M, K, N, nb0, nb1, 0);
}

static void blocks_i8(const float *x, const void *wp, const float *scale, const float *bias, float *y, long M,
                      long K, long N, long nb0, long nb1) {
    blocks(x, wp, scale, bias, y, M, K, N, nb0, nb1, 1);
}

extern int omp_get_thread_num(void);
extern int omp_get_num_threads(void);

static void run(const float *x, const void *wp, const float *scale, const float *bias, float *y, long M,
                long K, long N, int threads, const int I8) {
    void (*go)(const float *, const void *, const float *, const float *, float *, long, long, long, long,
               long) = I8 ? blocks_i8 : blocks_f32;
    long nblocks = (N + 15) / 16;
    if (threads <= 1 || nblocks < 2 * threads) {
        go(x, wp, scale, bias, y, M, K, N, 0, nblocks);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        long t = omp_get_thread_num(), n = omp_get_num_threads();
        /* whole pairs of blocks per thread */
        long pairs = (nblocks + 1) / 2, per = (pairs + n - 1) / n;
        long a = 2 * t * per, b = 2 * (t + 1) * per;
        if (b > nblocks) b = nblocks;
        if (a < b) go(x, wp, scale, bias, y, M, K, N, a, b);
    }
}

/* x [M, K] and y [M, N] contiguous; wp as above; bias: NULL or ceil(N / 16) * 16 floats */
void gptkit_cpu_linear(const float *x, const float *wp, const float *bias, float *y, long M, long K, long N,
                       int threads) {
    run(x, wp, NULL, bias, y, M, K, N, threads, 0);
}

/* the same with int8 weights wq (packed as wp) and scale: ceil(N / 16) * 16 floats */
void gptkit_cpu_linear_i8(const float *x, const signed char *wq, const float *scale, const float *bias,
                          float *y, long M, long K, long N, int threads) {
    run(x, wq, scale, bias, y, M, K, N, threads, 1);
}
