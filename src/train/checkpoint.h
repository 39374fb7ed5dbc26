/*
 * checkpoint.h -- kiln's training checkpoint container: atomic, crash-safe, self-checking.
 *
 * A checkpoint directory holds one subdirectory per saved step:
 *
 *     <dir>/step-<k>/state.kiln     the container (format below, docs/TRAINING_FORMATS.md)
 *     <dir>/step-<k>/COMPLETE       the completion marker, written last
 *
 * state.kiln is a list of named sections (config JSON, parameters, optimizer state, step,
 * RNG state, data position, ...), each 64-byte aligned and covered by its own SHA-256; the
 * section table is covered by a SHA-256 in the header, and the header by its own SHA-256,
 * which the COMPLETE marker repeats. A checkpoint is "complete" when its marker exists and
 * names the header hash of the state.kiln beside it; it is "valid" when, in addition, every
 * field and every checksum verifies.
 *
 * Save protocol (kiln_ckpt_begin .. kiln_ckpt_commit), so that a crash (kill -9, power loss)
 * at any instant leaves every previously completed checkpoint loadable and never shows a
 * half-written one as complete:
 *   1. write <dir>/step-<k>.tmp-<pid>/state.kiln (sections streamed in, table and header
 *      last), fsync the file, fsync the tmp directory;
 *   2. rename the tmp directory to <dir>/step-<k>, fsync <dir>;
 *   3. write step-<k>/COMPLETE.tmp, fsync it, rename it to COMPLETE, fsync step-<k>;
 *   4. housekeeping: remove tmp directories of dead writers, incomplete step directories
 *      older than k, and (keep_last > 0) the oldest complete checkpoints beyond keep_last,
 *      each by removing its marker first (so a crash mid-delete leaves it merely incomplete).
 * Any failure in 1-3 returns a clear error (path + errno text) and removes the partial tmp
 * directory (or the unmarked step directory). One writer per checkpoint directory.
 *
 * Loading (kiln_ckpt_open_latest) lists step-<k> directories, newest first, and returns the
 * first whose marker matches and whose state.kiln validates completely; tmp directories are
 * never considered. The reasons newer candidates were rejected are kept
 * (kiln_ckpt_rejected()) so a caller can warn. Resuming (kiln_ckpt_open_for_resume) also sets
 * aside each newer checkpoint that is complete but invalid, so the run can save its step again.
 *
 * Errors follow kiln's convention: a kiln_status and a thread-local message naming the path,
 * the section, the field and the offset.
 */
#ifndef KILN_TRAIN_CHECKPOINT_H
#define KILN_TRAIN_CHECKPOINT_H

#include "../base/base.h"
#include "../base/sha256.h"
#include "../base/tensor.h"

#include <stdint.h>

#define KILN_CKPT_MAGIC "KILNCKPT"
#define KILN_CKPT_VERSION 1u
#define KILN_CKPT_ALIGN 64u          /* every section starts at a multiple of this */
#define KILN_CKPT_NAME_MAX 127       /* bytes of a section name, without the NUL */
#define KILN_CKPT_MAX_DIMS 4         /* == KILN_MAX_DIMS */
#define KILN_CKPT_FILE "state.kiln"
#define KILN_CKPT_MARKER "COMPLETE"
#define KILN_CKPT_REASON "REASON"    /* in a set-aside directory: why (kiln_ckpt_set_aside) */
#define KILN_CKPT_MAX_STEP INT64_MAX /* steps fit a signed 64-bit count; the reader refuses more */
#define KILN_CKPT_SHARD_FMT "shard-%05d-of-%05d.kiln" /* rank, ranks: a set's files */
#define KILN_CKPT_MAX_SHARDS 65536

/* What a section holds. Stored as a u32; readers reject unknown values. */
typedef enum kiln_ckpt_type {
    KILN_CKPT_RAW = 1,    /* opaque bytes (optimizer state blob, RNG state, ...) */
    KILN_CKPT_JSON = 2,   /* UTF-8 JSON text, no NUL (configuration) */
    KILN_CKPT_U64 = 3,    /* one little-endian u64 (step, data position) */
    KILN_CKPT_TENSOR = 4, /* a tensor: dtype and shape in the table entry, size = nbytes */
} kiln_ckpt_type;

/* ---- writer --------------------------------------------------------------------------------- */

typedef struct kiln_ckpt_save_params {
    int keep_last; /* > 0: after a successful save keep only the newest keep_last complete
                      checkpoints in dir; 0: keep all */
} kiln_ckpt_save_params;

kiln_ckpt_save_params kiln_ckpt_default_save_params(void);

typedef struct kiln_ckpt_writer kiln_ckpt_writer;

/* Start saving step `step` (<= KILN_CKPT_MAX_STEP) into dir (created if missing, one level). Creates
 * <dir>/step-<step>.tmp-<pid>/ and opens state.kiln there. Refuses (KILN_ERR_STATE) when a
 * complete checkpoint of that step already exists; an incomplete step-<step> directory (a
 * crash between rename and marker) is replaced. params may be NULL (defaults).
 * On success *out owns the tmp directory until kiln_ckpt_commit or kiln_ckpt_abort. */
kiln_status kiln_ckpt_begin(const char *dir, uint64_t step, const kiln_ckpt_save_params *params,
                            kiln_ckpt_writer **out);

/* Append a whole section. name: 1..KILN_CKPT_NAME_MAX bytes of [A-Za-z0-9_.:/-], unique in
 * the checkpoint. data is copied to the file before the call returns (the caller keeps
 * ownership). For KILN_CKPT_U64 use kiln_ckpt_add_u64; for tensors kiln_ckpt_add_tensor. */
kiln_status kiln_ckpt_add_section(kiln_ckpt_writer *w, const char *name, kiln_ckpt_type type,
                                  const void *data, size_t size);
kiln_status kiln_ckpt_add_u64(kiln_ckpt_writer *w, const char *name, uint64_t value);
kiln_status kiln_ckpt_add_json(kiln_ckpt_writer *w, const char *name, const char *json);
/* A tensor section: data holds nbytes(dtype, prod(shape)) bytes, row-major; shape has
 * n_dims (1..4) entries, each >= 0. */
kiln_status kiln_ckpt_add_tensor(kiln_ckpt_writer *w, const char *name, kiln_dtype dtype,
                                 int n_dims, const int64_t *shape, const void *data);

/* A section written in pieces (an optimizer blob made of many buffers): section_begin, any
 * number of section_write, section_end. No other add_* call may come in between. */
kiln_status kiln_ckpt_section_begin(kiln_ckpt_writer *w, const char *name, kiln_ckpt_type type);
kiln_status kiln_ckpt_section_write(kiln_ckpt_writer *w, const void *data, size_t size);
kiln_status kiln_ckpt_section_end(kiln_ckpt_writer *w);

/* Finish the save (protocol steps 1-4 above). Always consumes w. On failure nothing new is
 * visible as complete, the tmp directory is removed, and the message names the path and the
 * errno text. A failure inside housekeeping (step 4) is not an error: the checkpoint is
 * complete; it is reported through *warning when warning is non-NULL (kiln_malloc'd text
 * the caller frees, or NULL). */
kiln_status kiln_ckpt_commit(kiln_ckpt_writer *w, char **warning);

/* Abandon a save: removes the tmp directory (a shard's writer: its file). NULL is a no-op. */
void kiln_ckpt_abort(kiln_ckpt_writer *w);

/* ---- sets of shards: one checkpoint written by N ranks --------------------------------------------
 *
 *     <dir>/step-<k>/shard-00000-of-0000N.kiln ... shard-<N-1>-of-<N>.kiln   one container a rank
 *     <dir>/step-<k>/COMPLETE    "KILNCKPT-COMPLETE step <k> shards <N>", then a line a shard:
 *                                "<file> header-sha256 <hex>" -- the manifest, written last
 *
 * The ranks share the file system. The protocol, the caller keeping the ranks in step (all
 * ranks agree after each stage; on a failure anywhere rank 0 calls kiln_ckpt_set_abort):
 *   1. one rank: kiln_ckpt_set_prepare makes <dir>/step-<k>.tmp-<tag>/ (tag: that rank's pid);
 *   2. every rank: kiln_ckpt_begin_shard, sections, kiln_ckpt_finish_shard (the file written
 *      and fsynced, its header hash out);
 *   3. one rank, with every rank's header hash: kiln_ckpt_set_commit (protocol steps 2-4 of a
 *      single file, the marker listing the shards).
 * A reader sees the set complete only with its marker, and opens it whole: every shard present,
 * each one's header hash the marker's, each one's step k (a set missing a shard or mixing two
 * saves is refused like a damaged file, and set aside on resume). kill -9 at any moment leaves
 * an unmarked directory that loading passes over and housekeeping removes. */
kiln_status kiln_ckpt_set_prepare(const char *dir, uint64_t step, long tag);
kiln_status kiln_ckpt_begin_shard(const char *dir, uint64_t step, long tag, int rank, int n_ranks,
                                  kiln_ckpt_writer **out);
/* Consumes w (also on failure, when its file is removed). */
kiln_status kiln_ckpt_finish_shard(kiln_ckpt_writer *w, uint8_t header_sha[32]);
/* header_shas: n_ranks x 32 bytes, rank order. keep_last as kiln_ckpt_save_params'. */
kiln_status kiln_ckpt_set_commit(const char *dir, uint64_t step, long tag, int n_ranks, const uint8_t *header_shas,
                                 int keep_last, char **warning);
void kiln_ckpt_set_abort(const char *dir, uint64_t step, long tag);

/* ---- fault injection (tests only) ------------------------------------------------------------ */

typedef enum kiln_ckpt_io_op {
    KILN_CKPT_IO_WRITE = 1, /* a write() of file data */
    KILN_CKPT_IO_FSYNC = 2, /* fsync of a file or a directory */
    KILN_CKPT_IO_RENAME = 3,
    KILN_CKPT_IO_MKDIR = 4,
} kiln_ckpt_io_op;

/* Called before each I/O operation of a save with the path involved; returning a nonzero
 * errno value makes the operation fail with that errno (as if the kernel had said ENOSPC or
 * EIO). NULL restores normal operation. Process-wide; not thread-safe; tests only. */
typedef int (*kiln_ckpt_fault_fn)(kiln_ckpt_io_op op, const char *path, void *user);
void kiln_ckpt_set_fault_hook(kiln_ckpt_fault_fn fn, void *user);

/* ---- reader ---------------------------------------------------------------------------------- */

typedef struct kiln_ckpt kiln_ckpt;

/* One section of an opened checkpoint. data points into the checkpoint's mapping (valid until
 * kiln_ckpt_close), 64-byte aligned, already checksum-verified. */
typedef struct kiln_ckpt_section {
    const char *name;
    kiln_ckpt_type type;
    kiln_dtype dtype;                   /* KILN_CKPT_TENSOR only */
    int n_dims;                         /* KILN_CKPT_TENSOR only, else 0 */
    int64_t shape[KILN_CKPT_MAX_DIMS];  /* KILN_CKPT_TENSOR only; unused dims 1 */
    const void *data;
    uint64_t size;                      /* bytes */
} kiln_ckpt_section;

/* The newest valid checkpoint in dir: complete (marker present and matching) and fully
 * verified. KILN_ERR_IO if dir cannot be read or holds no checkpoint at all; KILN_ERR_FORMAT
 * if checkpoints exist but none validates (the message lists each rejection). */
kiln_status kiln_ckpt_open_latest(const char *dir, kiln_ckpt **out);
/* kiln_ckpt_open_latest for a run that will continue and save again. A checkpoint newer than
 * the one returned that carries its COMPLETE marker but fails verification (KILN_ERR_FORMAT:
 * a damaged file, a stale marker) would refuse that later save of its step forever, so it is
 * set aside (kiln_ckpt_set_aside) - only once an older valid checkpoint was found; nothing is
 * moved when none validates. kiln_ckpt_rejected() names each one and where it went. A complete
 * candidate that fails otherwise (I/O error, unsupported version, no memory) stops the resume
 * with that error instead of being passed over. Unmarked directories are passed over as by
 * kiln_ckpt_open_latest (the next save of their step replaces them). */
kiln_status kiln_ckpt_open_for_resume(const char *dir, kiln_ckpt **out);
/* Move <dir>/step-<step> out of the way, never deleting it: writes <step dir>/REASON (a line
 * saying when and why, then `reason`), then renames the directory to
 * <dir>/step-<step>.rejected-<UTC yyyymmddThhmmssZ>[-n], a name the listing, the loader and
 * housekeeping ignore. *new_path (may be NULL) gets the new path (kiln_malloc'd). On failure
 * (KILN_ERR_IO with path and errno text) the directory stays where it was. */
kiln_status kiln_ckpt_set_aside(const char *dir, uint64_t step, const char *reason, char **new_path);
/* Exactly step `step` of dir (must be complete and valid). */
kiln_status kiln_ckpt_open_step(const char *dir, uint64_t step, kiln_ckpt **out);
/* kiln_ckpt_open_step, each section's checksum verified at its first kiln_ckpt_find instead
 * of at open (the marker, the header and the table are verified at open): for a reader that
 * reads part of a checkpoint another reader has verified whole (a data-parallel rank's shards,
 * after rank 0 opened the set for the resume). kiln_ckpt_section_at gives unverified sections. */
kiln_status kiln_ckpt_open_step_lazy(const char *dir, uint64_t step, kiln_ckpt **out);
/* One state.kiln file, verified alone (no marker involved). */
kiln_status kiln_ckpt_open_file(const char *path, kiln_ckpt **out);
void kiln_ckpt_close(kiln_ckpt *c); /* NULL is a no-op */

uint64_t kiln_ckpt_step(const kiln_ckpt *c);     /* the step recorded in the header */
const char *kiln_ckpt_path(const kiln_ckpt *c);  /* the state.kiln path opened */
/* Why newer checkpoints were passed over by kiln_ckpt_open_latest / _open_for_resume, one line
 * each, "[set aside as PATH]" after those set aside ("" if none). */
const char *kiln_ckpt_rejected(const kiln_ckpt *c);

/* 0: c is one state.kiln; N: c is shard 0 of a set of N, whose shard k (0 <= k < N; shard 0
 * is c itself) kiln_ckpt_shard gives (NULL out of range); each is closed with c. */
int kiln_ckpt_shard_count(const kiln_ckpt *c);
const kiln_ckpt *kiln_ckpt_shard(const kiln_ckpt *c, int k);

int kiln_ckpt_section_count(const kiln_ckpt *c);
/* Section i (0 <= i < count) in file order; NULL if i is out of range. */
const kiln_ckpt_section *kiln_ckpt_section_at(const kiln_ckpt *c, int i);
/* Section by name. KILN_ERR_FORMAT "missing section" if absent, or if it exists with another
 * type than `type` (pass 0 to accept any type). */
kiln_status kiln_ckpt_find(const kiln_ckpt *c, const char *name, kiln_ckpt_type type,
                           const kiln_ckpt_section **out);
kiln_status kiln_ckpt_get_u64(const kiln_ckpt *c, const char *name, uint64_t *out);

/* Steps of the complete checkpoints in dir (marker present; not verified), ascending.
 * *steps is kiln_malloc'd (NULL when *n == 0); the caller frees it. */
kiln_status kiln_ckpt_list(const char *dir, uint64_t **steps, size_t *n);

#endif /* KILN_TRAIN_CHECKPOINT_H */
