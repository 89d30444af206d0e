/* OpenBLAS kernel selection for CPUs that OpenBLAS 0.3.21 (Debian 12) does not recognise.
 *
 * OpenBLAS's DYNAMIC_ARCH build picks its sgemm kernels from the CPUID family/model when the
 * library is loaded. For CPUs newer than the release (e.g. Sapphire Rapids, family 6 model 207,
 * the machines this project is tested on) it falls back to the generic "Prescott" kernels:
 * measured 21 GFLOP/s versus 120-165 GFLOP/s with the SkylakeX (AVX-512) kernels on the same
 * core (kernels/cpu bench, 2048x576x1536 sgemm). The choice can only be overridden with the
 * OPENBLAS_CORETYPE environment variable, read once at load time (OpenBLAS
 * driver/others/dynamic.c, get_coretype/force_coretype), so a process must set it and re-exec
 * itself before any BLAS work. */
#include "kernels/kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *bt_openblas_coretype_for_cpu(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return "SkylakeX";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return "Haswell";
    return NULL;
}

void bt_openblas_env_reexec(char **argv)
{
    if (getenv("OPENBLAS_CORETYPE") || getenv("BT_NO_BLAS_REEXEC"))
        return;
    const char *ct = bt_openblas_coretype_for_cpu();
    if (!ct)
        return;
    setenv("OPENBLAS_CORETYPE", ct, 1);
    execv("/proc/self/exe", argv);
    /* exec failed (no /proc): carry on with OpenBLAS's own choice, which is only slower */
    fprintf(stderr, "warning: could not re-exec with OPENBLAS_CORETYPE=%s; BLAS may be slow\n", ct);
}
