/* plot_tool.c -- drives tests/python/test_plot_png.py (the plot writer is internal).
 *
 *   plot_tool curves OUT.png W H [TITLE]   plot two synthetic loss curves directly:
 *                                          "train" (0x1F77B4) at steps 1..2000 with a NaN
 *                                          every 97th step and on steps 1201..1260 (a
 *                                          ~20-pixel hole), "eval" (0xFF7F0E) every 100
 *                                          steps (NaN in between)
 *   plot_tool csv CSV OUT.png W H          write the same curves as a metrics CSV, then
 *                                          plot it with kiln_metrics_plot
 *   plot_tool empty OUT.png W H            a plot with no finite point
 *   plot_tool rgb OUT.png W H              a W x H gradient, r = x, g = y, b = x ^ y
 *                                          (low 8 bits), through kiln_png_write_rgb
 * Exit 0 on success; otherwise the kiln error message on stderr and exit 1.
 */
#include "train/metrics.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_STEPS 2000

/* A loss curve: exponential decay to 2.1, with deterministic wiggle (no RNG needed). */
static double train_loss(int step) {
    double t = (double)step;
    return 2.1 + 8.7 * exp(-t / 250.0) + 0.15 * sin(t * 0.37) * sin(t * 0.011) + 0.05 * sin(t * 1.7);
}

static double eval_loss(int step) { return 2.25 + 8.4 * exp(-(double)step / 270.0); }

static int fail(void) {
    fprintf(stderr, "plot_tool: %s\n", kiln_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: plot_tool curves|empty|rgb OUT.png W H [TITLE] | csv CSV OUT.png W H\n");
        return 2;
    }
    const char *mode = argv[1];
    int csv = !strcmp(mode, "csv");
    if (csv && argc < 6) return 2;
    const char *out = argv[csv ? 3 : 2];
    int w = atoi(argv[csv ? 4 : 3]), h = atoi(argv[csv ? 5 : 4]);

    if (!strcmp(mode, "rgb")) {
        uint8_t *img = malloc((size_t)w * (size_t)h * 3 + 1);
        if (!img) return 2;
        for (int y = 0; y < h; y++)
            for (int x = 0; x < w; x++) {
                uint8_t *p = img + ((size_t)y * (size_t)w + (size_t)x) * 3;
                p[0] = (uint8_t)x;
                p[1] = (uint8_t)y;
                p[2] = (uint8_t)(x ^ y);
            }
        kiln_status st = kiln_png_write_rgb(out, img, w, h);
        free(img);
        return st == KILN_OK ? 0 : fail();
    }

    static double x[N_STEPS], yt[N_STEPS], ye[N_STEPS];
    for (int i = 0; i < N_STEPS; i++) {
        int step = i + 1;
        x[i] = step;
        yt[i] = step % 97 == 0 || (step > 1200 && step <= 1260) ? NAN : train_loss(step);
        ye[i] = step % 100 == 0 || step == 1 ? eval_loss(step) : NAN;
    }
    if (!strcmp(mode, "curves") || !strcmp(mode, "empty")) {
        int empty = !strcmp(mode, "empty");
        if (empty)
            for (int i = 0; i < N_STEPS; i++) yt[i] = ye[i] = NAN;
        kiln_plot_series s[2] = {
            {"train", 0x1F77B4u, x, yt, N_STEPS},
            {"eval", 0xFF7F0Eu, x, ye, N_STEPS},
        };
        const char *title = argc > 5 ? argv[5] : "kiln train: synthetic run";
        return kiln_plot_write_png(out, w, h, title, s, 2) == KILN_OK ? 0 : fail();
    }
    if (csv) {
        kiln_metrics *m;
        if (kiln_metrics_open(argv[2], &m) != KILN_OK) return fail();
        for (int i = 0; i < N_STEPS; i++) {
            kiln_metrics_values v = kiln_metrics_values_empty();
            v.step = (uint64_t)(i + 1);
            v.loss = yt[i];
            v.eval_loss = ye[i];
            v.lr = 3e-4;
            v.elapsed_s = 0.05 * (i + 1);
            if (kiln_metrics_row(m, &v) != KILN_OK) {
                kiln_metrics_close(m);
                return fail();
            }
        }
        if (kiln_metrics_close(m) != KILN_OK) return fail();
        return kiln_metrics_plot(argv[2], out, w, h, "kiln train: from CSV") == KILN_OK ? 0 : fail();
    }
    fprintf(stderr, "plot_tool: unknown mode '%s'\n", mode);
    return 2;
}
