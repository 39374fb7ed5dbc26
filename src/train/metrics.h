/*
 * metrics.h -- what `kiln train` leaves behind besides checkpoints: a CSV of per-step metrics
 * and a PNG plot of the training and evaluation loss curves. Dependency-free (no zlib, no
 * image library): the PNG encoder, its CRC-32 and Adler-32, the line plot and its 5x7 bitmap
 * font are all here.
 *
 * The CSV (one header line, then one line per step, '\n' line ends):
 *   step,loss,eval_loss,lr,grad_norm,tokens_per_s,elapsed_s
 *   1,10.8249998,,0.0003,4.125,1543.2,0.25
 *   ...
 * step is an unsigned integer; every other cell is a decimal number that reads back to the
 * same double (shortest of %.15g/%.17g that round-trips), or empty when the value is absent
 * (NaN in kiln_metrics_values: e.g. eval_loss on steps without an evaluation). Each row is
 * written by one write() as soon as kiln_metrics_row is called, so a crash leaves a valid CSV
 * up to the last full row (at most a partial last line, which the reader ignores and a
 * resuming writer cuts off).
 *
 * The PNG: 8-bit RGB, not interlaced, filter 0 on every row, one IDAT holding a zlib stream of
 * stored (uncompressed) deflate blocks (RFC 1950/1951), so the file is 3*W*H bytes plus ~0.1%
 * (about 1.2 MB at 800x500). Written atomically: <path>.tmp-<pid>, fsync, rename, fsync of
 * the directory; a reader never sees a half-written plot.
 */
#ifndef KILN_TRAIN_METRICS_H
#define KILN_TRAIN_METRICS_H

#include "../base/base.h"

#include <stddef.h>
#include <stdint.h>

/* ---- checksums (the ones PNG and zlib use) ------------------------------------------------ */

/* CRC-32 (ISO-HDLC: reflected polynomial 0xEDB88320, init and final xor 0xFFFFFFFF), chained
 * like zlib's crc32(): start with crc = 0; kiln_crc32(kiln_crc32(0, a, na), b, nb) equals the
 * CRC of a followed by b. kiln_crc32(0, "123456789", 9) == 0xCBF43926. */
uint32_t kiln_crc32(uint32_t crc, const void *data, size_t n);
/* Adler-32 (RFC 1950), chained like zlib's adler32(): start with adler = 1.
 * kiln_adler32(1, "Wikipedia", 9) == 0x11E60398. */
uint32_t kiln_adler32(uint32_t adler, const void *data, size_t n);

/* ---- PNG -------------------------------------------------------------------------------- */

/* Write an RGB image to path atomically. rgb: (height, width, 3) bytes, rows top to bottom.
 * width, height in 1..32768. Errors name the path and the errno text (KILN_ERR_IO). */
kiln_status kiln_png_write_rgb(const char *path, const uint8_t *rgb, int width, int height);

/* ---- line plot -------------------------------------------------------------------------- */

typedef struct kiln_plot_series {
    const char *name;  /* legend text ("train", "eval"); NULL or "" leaves it out of the legend */
    uint32_t color;    /* 0xRRGGBB */
    const double *x;   /* (n) x values (the step) */
    const double *y;   /* (n) y values (the loss) */
    size_t n;
} kiln_plot_series;

/* Draw the series as lines on shared axes and write the plot to path as a PNG (atomically, as
 * kiln_png_write_rgb). x is labelled "step", y "loss"; both ranges are chosen automatically
 * from the finite points (with 5% padding on y, x from 0 when the first step is near it,
 * "nice" 1/2/5 ticks with numeric labels and a light grid); title (NULL for none) is drawn
 * centred on top, cut with "..." if wider than the image; a legend (top right) names every
 * series that has a name and a finite point; with no finite point at all the plot says
 * "no data". A point whose x or y is NaN or infinite is skipped: the line joins its finite
 * neighbours (so a sparse eval series, NaN on non-eval steps, draws as one line). Series with
 * few points per pixel also get a marker on each point. Points are drawn in the order given
 * (x should be increasing for a curve). The same inputs give the same bytes.
 * width in 160..8192, height in 120..8192; n_series <= 16; 800x500 is the intended size.
 * Text outside printable ASCII draws as '?'. */
kiln_status kiln_plot_write_png(const char *path, int width, int height, const char *title,
                                const kiln_plot_series *series, size_t n_series);

/* ---- metrics CSV ------------------------------------------------------------------------ */

#define KILN_METRICS_HEADER "step,loss,eval_loss,lr,grad_norm,tokens_per_s,elapsed_s"

/* One row. NaN means "absent" and writes an empty cell. */
typedef struct kiln_metrics_values {
    uint64_t step;
    double loss;         /* training loss of the step (mean over its tokens) */
    double eval_loss;    /* held-out loss, on evaluation steps only */
    double lr;           /* learning rate used by the step */
    double grad_norm;    /* global gradient norm before clipping */
    double tokens_per_s; /* throughput of the step */
    double elapsed_s;    /* wall time since the run (or the first run, on resume) began */
} kiln_metrics_values;

/* All fields NaN (absent) and step 0: start from this and fill what the step has. */
kiln_metrics_values kiln_metrics_values_empty(void);

typedef struct kiln_metrics kiln_metrics;

/* Create (or truncate) the CSV at path and write the header. */
kiln_status kiln_metrics_open(const char *path, kiln_metrics **out);

/* Continue an existing CSV after `--resume` from a checkpoint of step resume_step: the header
 * is checked (KILN_ERR_FORMAT if it is not KILN_METRICS_HEADER), a partial last line (a crash
 * mid-write) and every row with step > resume_step (steps done after that checkpoint, which
 * the resumed run redoes) are cut off, and rows are appended after what remains. A missing or
 * empty file is created as by kiln_metrics_open. */
kiln_status kiln_metrics_open_resume(const char *path, uint64_t resume_step, kiln_metrics **out);

/* Append one row and hand it to the kernel (one write(); no fsync per row). */
kiln_status kiln_metrics_row(kiln_metrics *m, const kiln_metrics_values *v);

/* fsync and close. The handle is freed even on error. NULL is a no-op returning KILN_OK. */
kiln_status kiln_metrics_close(kiln_metrics *m);

/* A whole CSV read back as columns (for re-plotting the whole history after a resume). */
typedef struct kiln_metrics_log {
    size_t n;             /* rows */
    uint64_t *step;       /* (n) */
    double *loss;         /* (n) NaN where the cell was empty */
    double *eval_loss;    /* (n) */
    double *lr;           /* (n) */
    double *grad_norm;    /* (n) */
    double *tokens_per_s; /* (n) */
    double *elapsed_s;    /* (n) */
} kiln_metrics_log;

/* Read a metrics CSV. The header must be KILN_METRICS_HEADER; a partial last line (no '\n')
 * is ignored; any other malformed line is KILN_ERR_FORMAT naming the path, line and column.
 * out owns its arrays: free with kiln_metrics_log_free. */
kiln_status kiln_metrics_read(const char *path, kiln_metrics_log *out);
void kiln_metrics_log_free(kiln_metrics_log *log);

/* Read the CSV at csv_path and plot its "train" (step, loss) and "eval" (step, eval_loss)
 * curves to png_path with kiln_plot_write_png (the train series blue, eval orange). */
kiln_status kiln_metrics_plot(const char *csv_path, const char *png_path, int width, int height,
                              const char *title);

#endif /* KILN_TRAIN_METRICS_H */
