/*
 * cpu_train.h -- the CPU backend's training operations that are larger than one kernel: the
 * bodies its table (cpu_backend.c) points at, in files of their own. The reference
 * implementations of the ops that fused_ce.h defines.
 */
#ifndef KILN_CPU_TRAIN_H
#define KILN_CPU_TRAIN_H

#include "../fused_ce.h"

/* ---- fused linear cross-entropy (cpu_fused_ce.c) ------------------------------------------ */

/* The table's fused_ce_workspace and fused_ce (ops.h) on the CPU backend be: host memory, the
 * backend's pool and matmul. */
size_t kiln_cpu_fused_ce_workspace(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S);
kiln_status kiln_cpu_fused_ce(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S,
                              kiln_fused_ce_result *out);

#endif /* KILN_CPU_TRAIN_H */
