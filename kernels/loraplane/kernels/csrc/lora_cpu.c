/* Multi-LoRA shrink / expand / fused apply for float32 CPU tensors (loraplane.kernels.cpu_backend).
 *
 * Weights come packed by the Python side (again for a slot when it changes), each slot at its own rank:
 *   A^T: per slot [d_in][width], width = round_up(n_slices * rank, 8), column s * rank + k = slice s's A row k;
 *   B:   per (slot, slice) [ceil(slice width / 32)][rank][32]: 32-column blocks of B^T, zero-padded.
 * Both are read front to back. (Read in place, a slot's A or B rows lie d * 4 bytes apart; at d = 4096 every one
 * of them maps to the same L1 sets, so they evict each other as they are used: 2-3x slower, measured.)
 *
 * Rows are addressed through the plan's sorted_tokens (position -> input row), segment by segment, so neither a
 * contiguous nor a gathered plan copies rows. A segment is done in chunks of at most CHUNK_ROWS rows whose
 * [rows x width] intermediate t lives on the stack: the shrink accumulates a 4-row x 16-column tile of t in
 * registers over a block of d_in (A^T block reused from L1 by every 4 rows); the expand accumulates a 2-row x
 * 32-column tile of y in registers over the rank (B block reused from L1 by every 2 rows) and adds it to y once.
 * Eight-float vectors are GNU C vector extensions (one AVX register, two SSE/NEON registers elsewhere).
 */
#include <stdint.h>
#include <string.h>

#define CHUNK_ROWS 64
#define T_FLOATS 8192   /* largest [chunk rows x width] intermediate on the stack (32 KiB) */
#define A_BLOCK 4096    /* floats of A^T per shrink block (16 KiB, half of L1) */
#define B_COLUMNS 32    /* columns per packed B block */

/* One layer: its packed slots and the plan of this step (see LoraSlots, BatchPlan and cpu_backend.py). */
typedef struct {
    int32_t n_segments;
    const int32_t *segment_slots, *segment_starts, *segment_rows;
    const int64_t *sorted_tokens;
    const int32_t *slot_ranks; /* exact rank per slot; 0 = empty */
    int32_t n_slices, rank_pad, d_in;
    const int64_t *slice_offsets, *slice_widths;
    const float *const *a_slots; /* per slot: its packed A^T (NULL when empty) */
    const float *const *b_slots; /* per slot * n_slices + slice: its packed B blocks */
} lp_layer;

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static int packed_width(const lp_layer *L, int rank) { return (L->n_slices * rank + 7) / 8 * 8; }

/* t[q][k0 .. k0 + 8 * vectors] += sum_d x_q[d] at[d][k0 ..] over d < depth, for four rows q (pointers may repeat:
 * a repeated row computes and stores the same values). */
static void shrink_tile(const float *at, int width, int depth, const float *const x[4], float *const t[4],
                        int vectors) {
    v8 p0 = load8(t[0]), p1 = load8(t[1]), p2 = load8(t[2]), p3 = load8(t[3]);
    if (vectors == 2) {
        v8 q0 = load8(t[0] + 8), q1 = load8(t[1] + 8), q2 = load8(t[2] + 8), q3 = load8(t[3] + 8);
        for (int d = 0; d < depth; d++) {
            v8 a0 = load8(at + (int64_t)d * width), a1 = load8(at + (int64_t)d * width + 8);
            float x0 = x[0][d], x1 = x[1][d], x2 = x[2][d], x3 = x[3][d];
            p0 += x0 * a0;
            q0 += x0 * a1;
            p1 += x1 * a0;
            q1 += x1 * a1;
            p2 += x2 * a0;
            q2 += x2 * a1;
            p3 += x3 * a0;
            q3 += x3 * a1;
        }
        store8(t[0] + 8, q0);
        store8(t[1] + 8, q1);
        store8(t[2] + 8, q2);
        store8(t[3] + 8, q3);
    } else {
        for (int d = 0; d < depth; d++) {
            v8 a0 = load8(at + (int64_t)d * width);
            p0 += x[0][d] * a0;
            p1 += x[1][d] * a0;
            p2 += x[2][d] * a0;
            p3 += x[3][d] * a0;
        }
    }
    store8(t[0], p0);
    store8(t[1], p1);
    store8(t[2], p2);
    store8(t[3], p3);
}

/* t[j][0 .. width) = x_j A^T for the chunk's rows (t rows `width` floats apart). */
static void shrink_chunk(const lp_layer *L, const float *at, int width, const float *const *x_rows, int rows,
                         float *t) {
    memset(t, 0, sizeof(float) * rows * width);
    int depth = A_BLOCK / width > 16 ? A_BLOCK / width : 16;
    for (int d0 = 0; d0 < L->d_in; d0 += depth) {
        int block = L->d_in - d0 < depth ? L->d_in - d0 : depth;
        const float *at_block = at + (int64_t)d0 * width;
        for (int j = 0; j < rows; j += 4) {
            const float *x[4];
            float *t_rows[4];
            for (int q = 0; q < 4; q++) {
                int row = j + q < rows ? j + q : rows - 1;
                x[q] = x_rows[row] + d0;
                t_rows[q] = t + row * width;
            }
            for (int k = 0; k < width; k += 16) {
                float *t_cols[4] = {t_rows[0] + k, t_rows[1] + k, t_rows[2] + k, t_rows[3] + k};
                shrink_tile(at_block + k, width, block, x, t_cols, width - k >= 16 ? 2 : 1);
            }
        }
    }
}

/* y_q[c] += sum_k t_q[k] b[k][c] for c < columns (<= 32) of one packed block, rows q = 0 and (if y1) 1. */
static void expand_tile(const float *b, int rank, const float *t0, const float *t1, float *y0, float *y1,
                        int columns) {
    v8 p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0}, q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};
    for (int k = 0; k < rank; k++) {
        const float *row = b + k * B_COLUMNS;
        v8 b0 = load8(row), b1 = load8(row + 8), b2 = load8(row + 16), b3 = load8(row + 24);
        float s = t0[k], u = t1[k];
        p0 += s * b0;
        p1 += s * b1;
        p2 += s * b2;
        p3 += s * b3;
        q0 += u * b0;
        q1 += u * b1;
        q2 += u * b2;
        q3 += u * b3;
    }
    if (columns == B_COLUMNS) {
        store8(y0, load8(y0) + p0);
        store8(y0 + 8, load8(y0 + 8) + p1);
        store8(y0 + 16, load8(y0 + 16) + p2);
        store8(y0 + 24, load8(y0 + 24) + p3);
        if (y1) {
            store8(y1, load8(y1) + q0);
            store8(y1 + 8, load8(y1 + 8) + q1);
            store8(y1 + 16, load8(y1 + 16) + q2);
            store8(y1 + 24, load8(y1 + 24) + q3);
        }
        return;
    }
    float sums[2][B_COLUMNS];
    store8(sums[0], p0);
    store8(sums[0] + 8, p1);
    store8(sums[0] + 16, p2);
    store8(sums[0] + 24, p3);
    store8(sums[1], q0);
    store8(sums[1] + 8, q1);
    store8(sums[1] + 16, q2);
    store8(sums[1] + 24, q3);
    for (int c = 0; c < columns; c++) {
        y0[c] += sums[0][c];
        if (y1) y1[c] += sums[1][c];
    }
}

/* y_j[offset + c] += t_j[first ..] . B_slice[:, c] for one slice's packed blocks, for the chunk's rows. */
static void expand_chunk(const float *b, int rank, int64_t offset, int64_t width, const float *t, int t_width,
                         int first, float *const *y_rows, int rows) {
    for (int64_t c = 0; c < width; c += B_COLUMNS) {
        int columns = width - c < B_COLUMNS ? (int)(width - c) : B_COLUMNS;
        const float *block = b + (c / B_COLUMNS) * rank * B_COLUMNS;
        for (int j = 0; j < rows; j += 2) {
            const float *t0 = t + j * t_width + first;
            int pair = j + 1 < rows;
            expand_tile(block, rank, t0, pair ? t0 + t_width : t0, y_rows[j] + offset + c,
                        pair ? y_rows[j + 1] + offset + c : NULL, columns);
        }
    }
}

typedef struct {
    const float *src;
    int64_t src_stride;
    float *dst;
    int64_t dst_stride;
} lp_io;

enum op { APPLY, SHRINK, EXPAND };

/* One chunk of one segment: rows at positions first .. first + rows of sorted_tokens. */
static void run_chunk(const lp_layer *L, const lp_io *io, enum op op, int slot, int rank, int64_t first, int rows) {
    int width = packed_width(L, rank);
    float t[T_FLOATS];
    const float *x_rows[CHUNK_ROWS];
    float *out_rows[CHUNK_ROWS];
    for (int j = 0; j < rows; j++) {
        int64_t row = L->sorted_tokens[first + j];
        x_rows[j] = io->src + row * io->src_stride;
        out_rows[j] = io->dst + row * io->dst_stride;
    }
    if (op == EXPAND) { /* t[row, s * rank_pad + k] -> the chunk's compact t */
        for (int j = 0; j < rows; j++)
            for (int s = 0; s < L->n_slices; s++)
                memcpy(t + j * width + s * rank, x_rows[j] + (int64_t)s * L->rank_pad, sizeof(float) * rank);
    } else {
        shrink_chunk(L, L->a_slots[slot], width, x_rows, rows, t);
    }
    if (op == SHRINK) {
        for (int j = 0; j < rows; j++)
            for (int s = 0; s < L->n_slices; s++)
                memcpy(out_rows[j] + (int64_t)s * L->rank_pad, t + j * width + s * rank, sizeof(float) * rank);
        return;
    }
    for (int s = 0; s < L->n_slices; s++)
        expand_chunk(L->b_slots[slot * L->n_slices + s], rank, L->slice_offsets[s],
                     L->slice_widths[s], t, width, s * rank, out_rows, rows);
}

typedef struct {
    const lp_layer *L;
    const lp_io *io;
    enum op op;
    int next_segment; /* taken atomically: a thread that falls behind (descheduled) simply takes fewer */
} lp_work;

static void *work(void *arg) {
    lp_work *w = arg;
    const lp_layer *L = w->L;
    for (;;) {
        int g = __atomic_fetch_add(&w->next_segment, 1, __ATOMIC_RELAXED);
        if (g >= L->n_segments) return NULL;
        int slot = L->segment_slots[g];
        int rank = L->slot_ranks[slot];
        if (rank <= 0) continue;
        int max_rows = T_FLOATS / packed_width(L, rank);
        if (max_rows > CHUNK_ROWS) max_rows = CHUNK_ROWS;
        int64_t start = L->segment_starts[g], end = start + L->segment_rows[g];
        for (int64_t first = start; first < end; first += max_rows)
            run_chunk(L, w->io, w->op, slot, rank, first, end - first < max_rows ? (int)(end - first) : max_rows);
    }
}

/* Segments are shared out to `threads` threads of the OpenMP pool; segments own disjoint rows of the output.
 * The library links the libgomp torch has loaded, so these are torch's own intra-op threads: no second pool
 * whose threads would compete with torch's spinning ones. Fewer threads when there are fewer than
 * MIN_THREAD_ROWS rows per thread. */
#define MIN_THREAD_ROWS 16

static void run(const lp_layer *L, const lp_io *io, enum op op, int threads) {
    lp_work w = {L, io, op, 0};
    int64_t rows = 0;
    for (int g = 0; g < L->n_segments; g++) rows += L->segment_rows[g];
    if (threads > rows / MIN_THREAD_ROWS) threads = (int)(rows / MIN_THREAD_ROWS);
    if (threads > L->n_segments) threads = L->n_segments;
    if (threads <= 1) {
        work(&w);
        return;
    }
#pragma omp parallel num_threads(threads)
    work(&w);
}

/* The largest packed width (n_slices * rank, rounded up to 8) one row of the stack intermediate holds. */
int lp_max_width(void) { return T_FLOATS; }

/* y[row] += x[row] A^T B^T per segment's slot (rows through sorted_tokens); other rows untouched. */
void lp_apply_f32(const lp_layer *L, const float *x, int64_t x_stride, float *y, int64_t y_stride, int threads) {
    lp_io io = {x, x_stride, y, y_stride};
    run(L, &io, APPLY, threads);
}

/* t[row, s * rank_pad + k] = x[row] . A_s[k] for k < the slot's rank; the caller zeroes t. */
void lp_shrink_f32(const lp_layer *L, const float *x, int64_t x_stride, float *t, int64_t t_stride, int threads) {
    lp_io io = {x, x_stride, t, t_stride};
    run(L, &io, SHRINK, threads);
}

/* y[row, slice s] += t[row, s * rank_pad .. + rank] B_s^T per segment's slot. */
void lp_expand_f32(const lp_layer *L, const float *t, int64_t t_stride, float *y, int64_t y_stride, int threads) {
    lp_io io = {t, t_stride, y, y_stride};
    run(L, &io, EXPAND, threads);
}
