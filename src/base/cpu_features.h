/*
 * cpu_features.h -- what the CPU we run on can do, found at run time (cpuid + xgetbv),
 * never assumed from compile-time -march flags.
 */
#ifndef KILN_CPU_FEATURES_H
#define KILN_CPU_FEATURES_H

typedef struct kiln_cpu_features {
    int avx2;     /* AVX2 with OS-enabled YMM state */
    int fma;      /* FMA3 */
    int f16c;     /* F16C (vcvtph2ps) */
    int avx512f;  /* AVX-512F with OS-enabled ZMM/opmask state */
    int avx512bw;
    int avx512vl;
    int avx512dq;   /* AVX-512DQ (vcvtqq2ps, ...) */
    int avx512vnni; /* AVX512_VNNI (vpdpbusd, vpdpwssd), with the ZMM state */
} kiln_cpu_features;

/* The CPU's features (detected once; cheap after the first call). */
const kiln_cpu_features *kiln_cpu_get_features(void);

/* The SIMD paths of the CPU backend, slowest first. */
typedef enum kiln_cpu_path {
    KILN_CPU_PATH_PORTABLE = 0, /* plain C with fmaf: the reference */
    KILN_CPU_PATH_AVX2,         /* AVX2 + FMA + F16C */
    KILN_CPU_PATH_AVX512,       /* AVX-512 F/BW/VL + FMA + F16C */
} kiln_cpu_path;

/* Best path this CPU supports. */
kiln_cpu_path kiln_cpu_best_path(void);
/* Whether the CPU (and OS) supports path p. */
int kiln_cpu_path_supported(kiln_cpu_path p);
/* The path to use: env KILN_CPU_PATH=portable|avx2|avx512 forces one (a path the CPU lacks
 * falls back to the best supported one below it), else the best. Read at each call. */
kiln_cpu_path kiln_cpu_select_path(void);
const char *kiln_cpu_path_name(kiln_cpu_path p);

#endif /* KILN_CPU_FEATURES_H */
