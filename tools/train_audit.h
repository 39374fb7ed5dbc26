/*
 * train_audit.h -- a training run's audit log (docs/REPRODUCIBILITY.md, "Training audit log"):
 * OUT/audit.jsonl, one JSON record a line, each chained to the one before by SHA-256.
 *
 *   line 1, the header: {"kind":"kiln-train-audit","version":1,"cwd":..,"argv":[..],
 *                        "start":S,"params":P0,"prev":"00..00","hash":H}
 *   then one line a step: {"step":k,"batch":B,"loss":L,"grad_norm":G,"lr":R,"params":P,
 *                          "prev":H_before,"hash":H}
 * B: SHA-256 of the step's token ids (every micro-batch's B x (T + 1) int32, little-endian, in
 * the order they were drawn); L and R: the bits of the step's loss and learning rate as
 * doubles, G of the gradient norm as a float ("0x" and 16 or 8 hex digits); P: the trainer's
 * fingerprint after the step (kiln_train_fingerprint), P0 before the first step of the run.
 * H: SHA-256 of the line's bytes up to `,"hash":` (so of every field and of prev), in hex. A
 * changed, removed or reordered record breaks the chain at the first line it touches.
 */
#ifndef KILN_TOOLS_TRAIN_AUDIT_H
#define KILN_TOOLS_TRAIN_AUDIT_H

#include <stdint.h>

typedef struct train_audit train_audit;

/* What a step leaves in its record. */
typedef struct audit_step {
    long step; /* 1-based: the step just taken */
    uint8_t batch[32];
    double loss, lr;
    float grad_norm;
    uint8_t params[32];
} audit_step;

/* Write mode (kiln train --audit): a new log at path (start 0), or, resuming at step `start`,
 * the existing one verified and cut after step start's record (a log that stops before start
 * is refused), then appended to. params0: the fingerprint before the run's first step (a new
 * log's header). argv: the command line the header records. Returns 0, or prints why not and
 * returns 1. */
int audit_open_write(const char *path, long start, int argc, char **argv, const uint8_t params0[32],
                     train_audit **out);
/* Replay mode (kiln audit): the log at path read and its chain verified (0 = intact; else it
 * prints the first broken line and returns 1). */
int audit_open_replay(const char *path, train_audit **out);
/* The header's command line (replay mode): argv[0..argc) and the directory it ran in; owned by
 * the log. */
void audit_command(const train_audit *a, int *argc, char ***argv, const char **cwd);
/* The steps the log holds: first and last step numbers (0, 0 when none). */
void audit_steps(const train_audit *a, long *first, long *last);
/* Write mode: append step's record (flushed). Replay mode: compare it with the log's record of
 * the same step; a difference is printed field by field. 0 = written or equal, 1 = differs or
 * failed. */
int audit_record(train_audit *a, const audit_step *step);
void audit_close(train_audit *a);

#endif
