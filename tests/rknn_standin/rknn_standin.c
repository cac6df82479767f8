/*
 * A stand-in for Rockchip's librknnrt matmul API, for tests on machines without the NPU.
 *
 * It implements the same C symbols with the documented semantics so that the Python
 * binding (ggml_rknpu/rknn/binding.py) is exercised for real: struct marshalling, context
 * and memory lifetimes, error codes. Everything here is written from
 * reference/rknn-toolkit.md §4 (structs §4.3, enums §4.2, layouts and alignment §4.4) and
 * the seed log; it is NOT the vendor library and says nothing about its speed.
 *
 * Behaviour, with sources:
 *  - types: 1 fp16xfp16->fp32 and 2 int8xint8->int32 run (seed M2, M8); 5..8
 *    (fp16 x int8/int4) fail with -5 and the runtime's message "unsupported matmul dtype ...
 *    in this platform" (seed M8, RK3588); any other type: -5 (not modelled here).
 *  - RK3588 alignment: K % 32 (fp16, int8); N % 16 fp16, N % 32 int8; K <= 10240 (§4.4).
 *  - layouts: A/C normal (row-major) or native ("perf"): A fp16 (K/8,M,8), int8 (K/16,M,16);
 *    C (N/4,M,4). B normal [K,N] or native fp16 (N/16,K/32,16,32), int8 (N/32,K/32,32,32),
 *    split into ceil(K/8192) native segments when K > 8192 (§4.4).
 *  - error codes: -1 failed, -5 parameter invalid, -7 context invalid.
 *  - the runtime failed beyond ~150 live contexts (seed M10: "rknn_matmul_run failed"):
 *    rknn_matmul_run returns -1 while more than STANDIN_MAX_CONTEXTS (env
 *    RKNN_STANDIN_MAX_CONTEXTS, default 150) contexts are alive.
 * Test-only introspection: standin_live_contexts(), standin_live_mems(), standin_runs().
 * Marker: ggml_rknpu_rknn_standin() is exported so that reports can say "stand-in"
 * (binding.RknnLibrary.is_standin); the vendor library has no such symbol.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef uint64_t rknn_context;

typedef struct {
    int32_t M, K, N, type;
    int16_t B_layout, B_quant_type, AC_layout, AC_quant_type;
    int32_t iommu_domain_id;
    int16_t group_size;
    int8_t reserved[34];
} rknn_matmul_info;

typedef struct {
    char name[256];
    uint32_t n_dims;
    uint32_t dims[16];
    uint32_t size;
    int32_t type;
} rknn_matmul_tensor_attr;

typedef struct { rknn_matmul_tensor_attr A, B, C; } rknn_matmul_io_attr;
typedef struct { int32_t M, K, N; } rknn_matmul_shape;

typedef struct {
    char name[256];
    float *scale;
    int32_t scale_len;
    int32_t *zp;
    int32_t zp_len;
} rknn_quant_params;

typedef struct {
    void *virt_addr;
    uint64_t phys_addr;
    int32_t fd, offset;
    uint32_t size, flags;
    void *priv_data;
} rknn_tensor_mem;

_Static_assert(sizeof(rknn_matmul_info) == 64, "rknn_matmul_info");
_Static_assert(sizeof(rknn_matmul_tensor_attr) == 332, "rknn_matmul_tensor_attr");
_Static_assert(sizeof(rknn_matmul_io_attr) == 996, "rknn_matmul_io_attr");
_Static_assert(sizeof(rknn_quant_params) == 288, "rknn_quant_params");
_Static_assert(sizeof(rknn_tensor_mem) == 40, "rknn_tensor_mem");

enum { OK = 0, ERR_FAIL = -1, ERR_PARAM = -5, ERR_CTX = -7 };
enum { T_FP32 = 0, T_FP16 = 1, T_INT8 = 2, T_INT32 = 6 };
#define MAX_CTX 4096
#define MAX_SHAPES 64
#define B_SEGMENT_K 8192

typedef struct {
    int live;
    rknn_matmul_info info;
    int n_shapes, cur;
    rknn_matmul_shape shapes[MAX_SHAPES];
    rknn_matmul_io_attr io[MAX_SHAPES];
    rknn_tensor_mem *mem[3]; /* A, B, C */
    int core_mask;
    int n_mems;
} ctx_t;

static ctx_t g_ctx[MAX_CTX];
static int g_live_ctx, g_live_mem, g_runs;

int standin_live_contexts(void) { return g_live_ctx; }
int standin_live_mems(void) { return g_live_mem; }
int standin_runs(void) { return g_runs; }
int ggml_rknpu_rknn_standin(void) { return 1; }

static ctx_t *lookup(rknn_context h) {
    if (h == 0 || h > MAX_CTX || !g_ctx[h - 1].live) return NULL;
    return &g_ctx[h - 1];
}

static int esize(int t) { return t == T_INT8 ? 1 : t == T_FP16 ? 2 : 4; }

static void set_attr(rknn_matmul_tensor_attr *a, const char *name, int type, int n,
                     const uint32_t *dims) {
    uint64_t count = 1;
    memset(a, 0, sizeof(*a));
    snprintf(a->name, sizeof(a->name), "%s", name);
    a->n_dims = (uint32_t)n;
    for (int i = 0; i < n; i++) { a->dims[i] = dims[i]; count *= dims[i]; }
    a->size = (uint32_t)(count * (uint64_t)esize(type));
    a->type = type;
}

static int check_and_fill(const rknn_matmul_info *info, int M, int K, int N, rknn_matmul_io_attr *io) {
    int in_t, out_t, kgrp;
    if (info->type >= 5 && info->type <= 8) {
        fprintf(stderr, "E RKNN: rknn_matmul_create, unsupported matmul dtype : %d in this platform\n",
                info->type);
        return ERR_PARAM;
    }
    if (info->type == 1) { in_t = T_FP16; out_t = T_FP32; kgrp = 16; }
    else if (info->type == 2) { in_t = T_INT8; out_t = T_INT32; kgrp = 32; }
    else { fprintf(stderr, "E RKNN(stand-in): matmul type %d not modelled\n", info->type); return ERR_PARAM; }
    if (M < 1 || K < 1 || N < 1 || K % 32 || N % kgrp || K > 10240) {
        fprintf(stderr, "E RKNN: invalid shape M=%d K=%d N=%d for type %d (K%%32, N%%%d, K<=10240)\n",
                M, K, N, info->type, kgrp);
        return ERR_PARAM;
    }
    int c2 = in_t == T_FP16 ? 8 : 16;
    if (info->AC_layout == 1) {
        uint32_t a[3] = {(uint32_t)(K / c2), (uint32_t)M, (uint32_t)c2};
        uint32_t c[3] = {(uint32_t)(N / 4), (uint32_t)M, 4};
        set_attr(&io->A, "A", in_t, 3, a);
        set_attr(&io->C, "C", out_t, 3, c);
    } else {
        uint32_t a[2] = {(uint32_t)M, (uint32_t)K}, c[2] = {(uint32_t)M, (uint32_t)N};
        set_attr(&io->A, "A", in_t, 2, a);
        set_attr(&io->C, "C", out_t, 2, c);
    }
    if (info->B_layout == 1) {
        uint32_t b[4] = {(uint32_t)(N / kgrp), (uint32_t)(K / 32), (uint32_t)kgrp, 32};
        set_attr(&io->B, "B", in_t, 4, b);
    } else {
        uint32_t b[2] = {(uint32_t)K, (uint32_t)N};
        set_attr(&io->B, "B", in_t, 2, b);
    }
    return OK;
}

static int alloc_ctx(void) {
    for (int i = 0; i < MAX_CTX; i++)
        if (!g_ctx[i].live) { memset(&g_ctx[i], 0, sizeof(g_ctx[i])); g_ctx[i].live = 1; g_live_ctx++; return i; }
    return -1;
}

int rknn_matmul_create(rknn_context *ctx, rknn_matmul_info *info, rknn_matmul_io_attr *io_attr) {
    if (!ctx || !info || !io_attr) return ERR_PARAM;
    rknn_matmul_io_attr io;
    int ret = check_and_fill(info, info->M, info->K, info->N, &io);
    if (ret) return ret;
    int i = alloc_ctx();
    if (i < 0) return ERR_FAIL;
    g_ctx[i].info = *info;
    g_ctx[i].n_shapes = 1;
    g_ctx[i].shapes[0] = (rknn_matmul_shape){info->M, info->K, info->N};
    g_ctx[i].io[0] = io;
    *io_attr = io;
    *ctx = (rknn_context)(i + 1);
    return OK;
}

int rknn_matmul_create_dynamic_shape(rknn_context *ctx, rknn_matmul_info *info, int shape_num,
                                     rknn_matmul_shape dynamic_shapes[], rknn_matmul_io_attr io_attrs[]) {
    if (!ctx || !info || !dynamic_shapes || !io_attrs || shape_num < 1 || shape_num > MAX_SHAPES)
        return ERR_PARAM;
    for (int s = 0; s < shape_num; s++) {
        int ret = check_and_fill(info, dynamic_shapes[s].M, dynamic_shapes[s].K, dynamic_shapes[s].N, &io_attrs[s]);
        if (ret) return ret;
    }
    int i = alloc_ctx();
    if (i < 0) return ERR_FAIL;
    g_ctx[i].info = *info;
    g_ctx[i].n_shapes = shape_num;
    for (int s = 0; s < shape_num; s++) { g_ctx[i].shapes[s] = dynamic_shapes[s]; g_ctx[i].io[s] = io_attrs[s]; }
    *ctx = (rknn_context)(i + 1);
    return OK;
}

int rknn_matmul_set_dynamic_shape(rknn_context h, rknn_matmul_shape *shape) {
    ctx_t *c = lookup(h);
    if (!c) return ERR_CTX;
    if (!shape) return ERR_PARAM;
    for (int s = 0; s < c->n_shapes; s++)
        if (c->shapes[s].M == shape->M && c->shapes[s].K == shape->K && c->shapes[s].N == shape->N) {
            c->cur = s;
            return OK;
        }
    return ERR_PARAM;
}

int rknn_matmul_set_core_mask(rknn_context h, int mask) {
    ctx_t *c = lookup(h);
    if (!c) return ERR_CTX;
    if (mask != 0 && mask != 1 && mask != 2 && mask != 4 && mask != 3 && mask != 7 && mask != 0xffff)
        return ERR_PARAM;
    c->core_mask = mask;
    return OK;
}

int rknn_matmul_set_quant_params(rknn_context h, rknn_quant_params *p) {
    ctx_t *c = lookup(h);
    if (!c) return ERR_CTX;
    if (!p || p->scale_len < 1 || !p->scale) return ERR_PARAM;
    if (p->scale_len != 1 && p->scale_len != c->shapes[c->cur].N) return ERR_PARAM;
    return OK;
}

int rknn_matmul_set_io_mem(rknn_context h, rknn_tensor_mem *mem, rknn_matmul_tensor_attr *attr) {
    ctx_t *c = lookup(h);
    if (!c) return ERR_CTX;
    if (!mem || !attr) return ERR_PARAM;
    int slot = attr->name[0] == 'A' ? 0 : attr->name[0] == 'B' ? 1 : attr->name[0] == 'C' ? 2 : -1;
    if (slot < 0 || attr->name[1] != 0) return ERR_PARAM;
    rknn_matmul_tensor_attr *want = slot == 0 ? &c->io[c->cur].A : slot == 1 ? &c->io[c->cur].B : &c->io[c->cur].C;
    if (mem->size < want->size) {
        fprintf(stderr, "E RKNN: set_io_mem %s: buffer %u < required %u bytes\n", attr->name, mem->size, want->size);
        return ERR_PARAM;
    }
    c->mem[slot] = mem;
    return OK;
}

rknn_tensor_mem *rknn_create_mem(rknn_context h, uint32_t size) {
    ctx_t *c = lookup(h);
    if (!c || size == 0) return NULL;
    rknn_tensor_mem *m = calloc(1, sizeof(*m));
    if (!m) return NULL;
    m->virt_addr = calloc(1, size);
    if (!m->virt_addr) { free(m); return NULL; }
    m->size = size;
    m->fd = -1;
    m->priv_data = (void *)(uintptr_t)h;
    c->n_mems++;
    g_live_mem++;
    return m;
}

int rknn_destroy_mem(rknn_context h, rknn_tensor_mem *m) {
    ctx_t *c = lookup(h);
    if (!c) return ERR_CTX;
    if (!m || (rknn_context)(uintptr_t)m->priv_data != h) return ERR_PARAM;
    for (int s = 0; s < 3; s++) if (c->mem[s] == m) c->mem[s] = NULL;
    free(m->virt_addr);
    free(m);
    c->n_mems--;
    g_live_mem--;
    return OK;
}

int rknn_mem_sync(rknn_context h, rknn_tensor_mem *m, int mode) {
    if (!lookup(h)) return ERR_CTX;
    if (!m || mode < 1 || mode > 3) return ERR_PARAM;
    return OK;
}

int rknn_matmul_destroy(rknn_context h) {
    ctx_t *c = lookup(h);
    if (!c) return ERR_CTX;
    c->live = 0;
    g_live_ctx--;
    return OK;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | man << 13;
    else bits = sign | (exp + 127 - 15) << 23 | man << 13;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* element (k, n) of B in the native layout; segments of 8192 K when K > 8192 (§4.4) */
static size_t b_native_index(int k, int n, int K, int N, int kgrp) {
    int seg = k / B_SEGMENT_K, k0 = seg * B_SEGMENT_K;
    int Ks = K - k0 < B_SEGMENT_K ? K - k0 : B_SEGMENT_K, kk = k - k0;
    size_t base = (size_t)k0 * (size_t)N;
    return base + (size_t)(n / kgrp) * (size_t)kgrp * (size_t)Ks + (size_t)(kk / 32) * (size_t)kgrp * 32
           + (size_t)(n % kgrp) * 32 + (size_t)(kk % 32);
}

static size_t a_index(int m, int k, int M, int K, int native, int c2) {
    (void)K;
    return native ? (size_t)(k / c2) * (size_t)M * c2 + (size_t)m * c2 + (size_t)(k % c2) : (size_t)m * K + k;
}

static size_t c_index(int m, int n, int M, int N, int native) {
    return native ? (size_t)(n / 4) * (size_t)M * 4 + (size_t)m * 4 + (size_t)(n % 4) : (size_t)m * N + n;
}

int rknn_B_normal_layout_to_native_layout(void *B_input, void *B_output, int K, int N, rknn_matmul_info *info) {
    if (!B_input || !B_output || !info || K < 1 || N < 1 || K % 32) return ERR_PARAM;
    int kgrp = info->type == 1 ? 16 : info->type == 2 ? 32 : 0;
    if (!kgrp || N % kgrp) return ERR_PARAM;
    int es = info->type == 1 ? 2 : 1;
    for (int k = 0; k < K; k++)
        for (int n = 0; n < N; n++)
            memcpy((char *)B_output + b_native_index(k, n, K, N, kgrp) * es,
                   (char *)B_input + ((size_t)k * N + n) * es, es);
    return OK;
}

int rknn_matmul_run(rknn_context h) {
    ctx_t *c = lookup(h);
    if (!c) return ERR_CTX;
    const char *env = getenv("RKNN_STANDIN_MAX_CONTEXTS");
    int limit = env ? atoi(env) : 150;
    if (g_live_ctx > limit) {
        fprintf(stderr, "E RKNN: rknn_matmul_run failed (%d live matmul contexts)\n", g_live_ctx);
        return ERR_FAIL;
    }
    if (!c->mem[0] || !c->mem[1] || !c->mem[2]) return ERR_PARAM;
    rknn_matmul_shape s = c->shapes[c->cur];
    int M = s.M, K = s.K, N = s.N, fp16 = c->info.type == 1;
    int kgrp = fp16 ? 16 : 32, c2 = fp16 ? 8 : 16;
    int a_native = c->info.AC_layout == 1, b_native = c->info.B_layout == 1;
    const void *A = c->mem[0]->virt_addr, *B = c->mem[1]->virt_addr;
    void *C = c->mem[2]->virt_addr;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float accf = 0.0f;
            int32_t acci = 0;
            for (int k = 0; k < K; k++) {
                size_t ai = a_index(m, k, M, K, a_native, c2);
                size_t bi = b_native ? b_native_index(k, n, K, N, kgrp) : (size_t)k * N + n;
                if (fp16) accf += half_to_float(((const uint16_t *)A)[ai]) * half_to_float(((const uint16_t *)B)[bi]);
                else acci += (int32_t)((const int8_t *)A)[ai] * (int32_t)((const int8_t *)B)[bi];
            }
            size_t ci = c_index(m, n, M, N, a_native);
            if (fp16) ((float *)C)[ci] = accf;
            else ((int32_t *)C)[ci] = acci;
        }
    g_runs++;
    return OK;
}
