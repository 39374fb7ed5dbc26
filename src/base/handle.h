/*
 * handle.h -- the registry of live public handles (docs/API.md, "Safe handles").
 *
 * Every public handle (kiln_model, kiln_tokenizer, kiln_context, kiln_sampler,
 * kiln_detok_stream, kiln_trainer, kiln_linear_ce, kiln_engine, kiln_teacher) starts with a kiln_handle_head and is
 * entered in one process-wide table, keyed by its address, from the moment it is made until it
 * is freed. A public entry looks the pointer it was given up in the table BEFORE it reads
 * anything through it: a pointer that is not there (freed, never made by kiln, garbage) or is
 * there as another kind is refused with KILN_ERR_BAD_HANDLE and never dereferenced. Only a
 * registered pointer is read; its head must then carry its kind's magic, else the memory was
 * overwritten under kiln and the call fails with KILN_ERR_PANIC.
 *
 * The table also counts each handle's users (a model's contexts, trainers and detok streams;
 * a tokenizer's detok streams): a handle with users cannot be unregistered, so a model is never
 * freed under a context.
 *
 * One mutex guards the table; a lookup is a hash probe. The table lives in kiln's allocator
 * and is freed when the last handle goes, so an idle process holds no block for it.
 *
 * Limit (documented in kiln.h): a handle is a raw address, so once the allocator hands a freed
 * handle's address to a NEW handle of the same kind, a stale copy of the old pointer reaches
 * the new handle. Every other misuse (a second free, a use after free before that reuse, a
 * pointer of another kind, a pointer kiln never made) is refused.
 */
#ifndef KILN_HANDLE_H
#define KILN_HANDLE_H

#include "base.h"

typedef enum kiln_handle_kind {
    KILN_HANDLE_MODEL = 1,
    KILN_HANDLE_TOKENIZER,
    KILN_HANDLE_CONTEXT,
    KILN_HANDLE_SAMPLER,
    KILN_HANDLE_DETOK_STREAM,
    KILN_HANDLE_TRAINER,
    KILN_HANDLE_LINEAR_CE,
    KILN_HANDLE_ENGINE,
    KILN_HANDLE_TEACHER,
    KILN_HANDLE_KIND_COUNT
} kiln_handle_kind;

/* The first member of every public handle's struct. magic is the kind's own while the handle
 * is registered and KILN_HANDLE_DEAD from its unregistering on (the struct is freed right
 * after, so the dead magic only helps a debugger or a sanitizer report). */
typedef struct kiln_handle_head {
    uint32_t magic;
    uint32_t kind;
} kiln_handle_head;

#define KILN_HANDLE_DEAD 0x44454144u /* "DEAD" */

/* The public type's name ("kiln_context", ...) of a kind. */
const char *kiln_handle_kind_name(kiln_handle_kind kind);

/* Enter h (a new handle of kind) in the table and stamp its head. KILN_ERR_NOMEM (naming fn)
 * when the table cannot grow; h is then not registered. */
kiln_status kiln_handle_register(kiln_handle_head *h, kiln_handle_kind kind, const char *fn);

/* KILN_OK when h is a live handle of kind. Else, naming fn and the kind, without reading *h:
 * KILN_ERR_INVALID_ARG for NULL, KILN_ERR_BAD_HANDLE for a pointer that is not a live handle
 * of that kind; KILN_ERR_PANIC when it is registered but its head was overwritten. */
kiln_status kiln_handle_check(const void *h, kiln_handle_kind kind, const char *fn);

/* kiln_handle_check, and count one more user of h (atomically with the check). */
kiln_status kiln_handle_acquire(const void *h, kiln_handle_kind kind, const char *fn);
/* One user fewer. A release without an acquire is an invariant broken inside kiln: it is
 * recorded (KILN_ERR_PANIC, naming fn) and the count left at 0. */
void kiln_handle_release(const void *h, const char *fn);

/* KILN_OK when h is a live handle of kind with exactly one user (the caller's own); else the
 * check's errors, or KILN_ERR_STATE naming fn and the number of users. (A user acquired by
 * another thread right after it is the caller's to prevent.) */
kiln_status kiln_handle_sole_user(const void *h, kiln_handle_kind kind, const char *fn);

/* Take h out of the table so that it can be freed: KILN_OK, and its head now carries the dead
 * magic. Refused (h stays registered, nothing changes) with the check's errors, or with
 * KILN_ERR_STATE naming the number of users while any remain. */
kiln_status kiln_handle_unregister(kiln_handle_head *h, kiln_handle_kind kind, const char *fn);

/* Number of registered handles (all kinds). */
size_t kiln_handle_count(void);

#endif /* KILN_HANDLE_H */
