/*
 * cpu_features.c -- cpuid / xgetbv feature detection and the choice of the SIMD path.
 *
 * A feature is usable only when the CPU reports it (cpuid) AND the OS saves its register
 * state on context switches (XCR0 via xgetbv: bits 1-2 for XMM/YMM, bits 5-7 for the
 * AVX-512 opmask and ZMM state). AMX is deliberately not used: it needs arch_prctl
 * permission on Linux.
 */
#include "cpu_features.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static unsigned long long read_xcr0(void) {
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}

static void detect(kiln_cpu_features *f) {
    unsigned int a, b, c, d;
    memset(f, 0, sizeof *f);
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
    int fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return;
    unsigned long long xcr0 = read_xcr0();
    int ymm_ok = (xcr0 & 0x6) == 0x6;
    int zmm_ok = ymm_ok && (xcr0 & 0xe0) == 0xe0;
    if (!ymm_ok) return;
    f->fma = fma;
    f->f16c = f16c;
    if (__get_cpuid_max(0, NULL) < 7) return;
    __cpuid_count(7, 0, a, b, c, d);
    f->avx2 = (b >> 5) & 1;
    if (zmm_ok) {
        f->avx512f = (b >> 16) & 1;
        f->avx512bw = (b >> 30) & 1;
        f->avx512vl = (b >> 31) & 1;
        f->avx512dq = (b >> 17) & 1;
        f->avx512vnni = (c >> 11) & 1;
    }
}
#else
static void detect(kiln_cpu_features *f) { memset(f, 0, sizeof *f); }
#endif

static kiln_cpu_features g_features;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static void detect_once(void) { detect(&g_features); }

const kiln_cpu_features *kiln_cpu_get_features(void) {
    pthread_once(&g_once, detect_once);
    return &g_features;
}

int kiln_cpu_path_supported(kiln_cpu_path p) {
    const kiln_cpu_features *f = kiln_cpu_get_features();
    switch (p) {
    case KILN_CPU_PATH_PORTABLE: return 1;
    case KILN_CPU_PATH_AVX2: return f->avx2 && f->fma && f->f16c;
    case KILN_CPU_PATH_AVX512:
        return f->avx512f && f->avx512bw && f->avx512vl && f->fma && f->f16c;
    }
    return 0;
}

kiln_cpu_path kiln_cpu_best_path(void) {
    if (kiln_cpu_path_supported(KILN_CPU_PATH_AVX512)) return KILN_CPU_PATH_AVX512;
    if (kiln_cpu_path_supported(KILN_CPU_PATH_AVX2)) return KILN_CPU_PATH_AVX2;
    return KILN_CPU_PATH_PORTABLE;
}

kiln_cpu_path kiln_cpu_select_path(void) {
    const char *e = getenv("KILN_CPU_PATH");
    kiln_cpu_path want = kiln_cpu_best_path();
    if (e && *e) {
        if (!strcmp(e, "portable")) want = KILN_CPU_PATH_PORTABLE;
        else if (!strcmp(e, "avx2")) want = KILN_CPU_PATH_AVX2;
        else if (!strcmp(e, "avx512")) want = KILN_CPU_PATH_AVX512;
    }
    while (want > KILN_CPU_PATH_PORTABLE && !kiln_cpu_path_supported(want))
        want = (kiln_cpu_path)(want - 1);
    return want;
}

const char *kiln_cpu_path_name(kiln_cpu_path p) {
    switch (p) {
    case KILN_CPU_PATH_PORTABLE: return "portable";
    case KILN_CPU_PATH_AVX2: return "avx2";
    case KILN_CPU_PATH_AVX512: return "avx512";
    }
    return "?";
}
