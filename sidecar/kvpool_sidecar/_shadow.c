/* A self-tuner's shadow cache, compiled: what PythonShadowCore in tests/sidecar/oracles.py does,
 * decision for decision. tests/sidecar/test_adaptive.py feeds the two the same prompts and compares
 * their scores and every queue, key by key, touch time by touch time.
 *
 * Why in C: six shadows replay a sampled share of every prompt's pages (half of them at 1 % of the
 * chat trace), a few dict operations per page and shadow: the largest cost of a replay with the
 * default policy once the sketch was compiled.
 *
 * The structures follow the reference one for one: a table of cached keys (open addressing,
 * linear probing, backward-shift deletion) whose entries link into FIFO queues, one per (scale,
 * count) in creation order, and a heap of lower bounds of the queues' head ranks ordered by (rank,
 * serial), with the serials handed out at the same steps, so that ties break the same way.
 * A key is its hash: a shadow estimates hit ratios, and two sampled keys of one hash (one pair in
 * about 2^40 for a million keys) move it by one page. So the core holds no Python object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

typedef struct {
    Py_hash_t hash; /* the key */
    double touched;
    Py_ssize_t slot; /* its place in the table; -1: a free entry */
    int32_t queue;
    int32_t prev, next; /* within its queue; next also links the free entries */
} Entry;

typedef struct {
    double scale;
    long count;
    int32_t head, tail;
    Py_ssize_t len;
} Queue;

typedef struct {
    double rank;
    long long serial;
    int32_t queue;
    Py_hash_t head; /* the key the entry was made for */
} HeapItem;

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity;
    double weight;
    Entry *entries;
    Py_ssize_t entries_alloc;
    int32_t free_entry;
    Py_ssize_t len;
    int32_t *table;
    Py_ssize_t table_mask;
    Queue *queues;
    Py_ssize_t nqueues, queues_alloc;
    HeapItem *heap;
    Py_ssize_t heap_len, heap_alloc;
    PyObject *heap_p; /* owned: the curve the heap's ranks were computed with */
    PyObject *loaded_p; /* owned: the curve whose values p holds (a curve is never changed in place) */
    double *p;
    Py_ssize_t p_len;
    long long serial;
    int busy; /* in a replay: a key's __hash__ or __eq__ calling back in is refused */
} ShadowCore;

/* ------------------------------------------------------------------------------ the key table */

/* The entry of key h, -1 when absent. */
static int32_t
find(ShadowCore *s, Py_hash_t h)
{
    Py_ssize_t i = (Py_ssize_t)((size_t)h & (size_t)s->table_mask);
    for (;;) {
        int32_t e = s->table[i];
        if (e < 0 || s->entries[e].hash == h)
            return e;
        i = (i + 1) & s->table_mask;
    }
}

static int
resize_table(ShadowCore *s, Py_ssize_t size)
{
    int32_t *table = PyMem_Malloc(sizeof(int32_t) * (size_t)size);
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < size; i++)
        table[i] = -1;
    PyMem_Free(s->table);
    s->table = table;
    s->table_mask = size - 1;
    for (int32_t e = 0; e < (int32_t)s->entries_alloc; e++) {
        if (s->entries[e].slot < 0)
            continue;
        Py_ssize_t i = (Py_ssize_t)((size_t)s->entries[e].hash & (size_t)s->table_mask);
        while (table[i] >= 0)
            i = (i + 1) & s->table_mask;
        table[i] = e;
        s->entries[e].slot = i;
    }
    return 0;
}

/* A new entry for key h (not in the table), its queue fields unset; -1 on no memory. */
static int32_t
add_entry(ShadowCore *s, Py_hash_t h)
{
    if (2 * (s->len + 1) > s->table_mask + 1 && resize_table(s, 2 * (s->table_mask + 1)) < 0)
        return -1;
    if (s->free_entry < 0) {
        Py_ssize_t grown = s->entries_alloc ? 2 * s->entries_alloc : 64;
        if (grown > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "shadow too large");
            return -1;
        }
        Entry *entries = PyMem_Realloc(s->entries, sizeof(Entry) * (size_t)grown);
        if (entries == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t e = s->entries_alloc; e < grown; e++) {
            entries[e].slot = -1;
            entries[e].next = e + 1 < grown ? (int32_t)(e + 1) : -1;
        }
        s->entries = entries;
        s->free_entry = (int32_t)s->entries_alloc;
        s->entries_alloc = grown;
    }
    int32_t e = s->free_entry;
    s->free_entry = s->entries[e].next;
    Py_ssize_t i = (Py_ssize_t)((size_t)h & (size_t)s->table_mask);
    while (s->table[i] >= 0)
        i = (i + 1) & s->table_mask;
    s->table[i] = e;
    s->entries[e].hash = h;
    s->entries[e].slot = i;
    s->len++;
    return e;
}

/* Out of the table (backward-shift deletion, no tombstones) and back to the free entries. */
static void
drop_entry(ShadowCore *s, int32_t e)
{
    Py_ssize_t mask = s->table_mask, i = s->entries[e].slot, j = i;
    s->table[i] = -1;
    for (;;) {
        j = (j + 1) & mask;
        int32_t moved = s->table[j];
        if (moved < 0)
            break;
        Py_ssize_t home = (Py_ssize_t)((size_t)s->entries[moved].hash & (size_t)mask);
        /* moved may fill the hole at i unless its home lies cyclically in (i, j] */
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            s->table[i] = moved;
            s->entries[moved].slot = i;
            s->table[j] = -1;
            i = j;
        }
    }
    s->entries[e].slot = -1;
    s->entries[e].next = s->free_entry;
    s->free_entry = e;
    s->len--;
}

/* ---------------------------------------------------------------------------------- queues */

static void
unlink_entry(ShadowCore *s, int32_t e)
{
    Entry *en = &s->entries[e];
    Queue *q = &s->queues[en->queue];
    if (en->prev >= 0)
        s->entries[en->prev].next = en->next;
    else
        q->head = en->next;
    if (en->next >= 0)
        s->entries[en->next].prev = en->prev;
    else
        q->tail = en->prev;
    q->len--;
}

static void
append_entry(ShadowCore *s, int32_t e, int32_t queue)
{
    Entry *en = &s->entries[e];
    Queue *q = &s->queues[queue];
    en->queue = queue;
    en->prev = q->tail;
    en->next = -1;
    if (q->tail >= 0)
        s->entries[q->tail].next = e;
    else
        q->head = e;
    q->tail = e;
    q->len++;
}

/* The queue of (scale, count), made (last in creation order) when new; -1 on no memory. */
static int32_t
queue_of(ShadowCore *s, double scale, long count)
{
    for (Py_ssize_t q = 0; q < s->nqueues; q++)
        if (s->queues[q].scale == scale && s->queues[q].count == count)
            return (int32_t)q;
    if (s->nqueues == s->queues_alloc) {
        Py_ssize_t grown = s->queues_alloc ? 2 * s->queues_alloc : 16;
        Queue *queues = PyMem_Realloc(s->queues, sizeof(Queue) * (size_t)grown);
        if (queues == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->queues = queues;
        s->queues_alloc = grown;
    }
    Queue *q = &s->queues[s->nqueues];
    q->scale = scale;
    q->count = count;
    q->head = q->tail = -1;
    q->len = 0;
    return (int32_t)s->nqueues++;
}

/* ------------------------------------------------------------------------------------ heap */

static int
heap_less(const HeapItem *a, const HeapItem *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->serial < b->serial);
}

static void
sift_down(ShadowCore *s, Py_ssize_t i)
{
    HeapItem *h = s->heap;
    Py_ssize_t n = s->heap_len;
    HeapItem item = h[i];
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= n)
            break;
        if (child + 1 < n && heap_less(&h[child + 1], &h[child]))
            child++;
        if (!heap_less(&h[child], &item))
            break;
        h[i] = h[child];
        i = child;
    }
    h[i] = item;
}

static int
heap_push(ShadowCore *s, HeapItem item)
{
    if (s->heap_len == s->heap_alloc) {
        Py_ssize_t grown = s->heap_alloc ? 2 * s->heap_alloc : 64;
        HeapItem *heap = PyMem_Realloc(s->heap, sizeof(HeapItem) * (size_t)grown);
        if (heap == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->heap = heap;
        s->heap_alloc = grown;
    }
    Py_ssize_t i = s->heap_len++;
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!heap_less(&item, &s->heap[parent]))
            break;
        s->heap[i] = s->heap[parent];
        i = parent;
    }
    s->heap[i] = item;
    return 0;
}

static void
heap_pop(ShadowCore *s)
{
    s->heap[0] = s->heap[--s->heap_len];
    if (s->heap_len)
        sift_down(s, 0);
}

static void
heap_replace(ShadowCore *s, HeapItem item)
{
    s->heap[0] = item;
    sift_down(s, 0);
}

/* base.run_limit: the lowest rank after the top's (the root's children). */
static double
run_limit(ShadowCore *s)
{
    if (s->heap_len < 3)
        return s->heap_len == 2 ? s->heap[1].rank : Py_HUGE_VAL;
    return s->heap[1].rank < s->heap[2].rank ? s->heap[1].rank : s->heap[2].rank;
}

static double
credit(ShadowCore *s, int32_t queue)
{
    Queue *q = &s->queues[queue];
    return q->scale * s->weight * s->p[q->count];
}

static HeapItem
head_entry(ShadowCore *s, int32_t queue, double gain)
{
    Entry *first = &s->entries[s->queues[queue].head];
    HeapItem item = {first->touched + gain, ++s->serial, queue, first->hash};
    return item;
}

/* The curve p (a sequence of floats) as this shadow's credits read it. */
static int
load_curve(ShadowCore *s, PyObject *p)
{
    PyObject *seq = PySequence_Fast(p, "p must be a sequence of floats");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "p must not be empty (a credit reads p[count])");
        return -1;
    }
    double *values = PyMem_Realloc(s->p, sizeof(double) * (size_t)(n ? n : 1));
    if (values == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    s->p = values;
    for (Py_ssize_t c = 0; c < n; c++) {
        values[c] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, c));
        if (values[c] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    s->p_len = n;
    Py_DECREF(seq);
    return 0;
}

static int
rebuild(ShadowCore *s, PyObject *p)
{
    s->heap_len = 0;
    Py_INCREF(p);
    Py_XSETREF(s->heap_p, p);
    for (int32_t q = 0; q < (int32_t)s->nqueues; q++)
        if (s->queues[q].len && heap_push(s, head_entry(s, q, credit(s, q))) < 0)
            return -1;
    return 0;
}

static int
evict(ShadowCore *s, Py_ssize_t over, PyObject *p)
{
    if (p != s->heap_p || s->heap_len > 4 * s->nqueues + 64) {
        if (rebuild(s, p) < 0)
            return -1;
    }
    while (over > 0) {
        if (!s->heap_len) { /* every queue with keys has an entry: a bug, not an input */
            PyErr_SetString(PyExc_RuntimeError, "shadow: keys over capacity and no queue head in the heap");
            return -1;
        }
        HeapItem *top = &s->heap[0];
        int32_t queue = top->queue;
        Queue *q = &s->queues[queue];
        if (!q->len) {
            heap_pop(s);
            continue;
        }
        double gain = credit(s, queue);
        Entry *first = &s->entries[q->head];
        if (first->hash != top->head || first->touched + gain != top->rank) {
            heap_replace(s, head_entry(s, queue, gain));
            continue;
        }
        double limit = run_limit(s);
        int32_t e = q->head;
        unlink_entry(s, e);
        drop_entry(s, e);
        over--;
        while (over && q->len) {
            e = q->head;
            if (s->entries[e].touched + gain > limit)
                break; /* beyond the run: it stays the head */
            unlink_entry(s, e);
            drop_entry(s, e);
            over--;
        }
        if (q->len)
            heap_replace(s, head_entry(s, queue, gain));
        else
            heap_pop(s);
    }
    return 0;
}

/* ------------------------------------------------------------------------------- the type */

static PyObject *
core_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", "weight", NULL};
    Py_ssize_t capacity;
    double weight;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nd:ShadowCore", kwlist, &capacity, &weight))
        return NULL;
    if (capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "capacity must be at least 1");
        return NULL;
    }
    ShadowCore *s = (ShadowCore *)type->tp_alloc(type, 0);
    if (s == NULL)
        return NULL;
    s->capacity = capacity;
    s->weight = weight;
    s->free_entry = -1;
    s->table_mask = -1;
    if (resize_table(s, 64) < 0) {
        Py_DECREF(s);
        return NULL;
    }
    return (PyObject *)s;
}

static void
core_dealloc(ShadowCore *s)
{
    Py_XDECREF(s->heap_p);
    Py_XDECREF(s->loaded_p);
    PyMem_Free(s->entries);
    PyMem_Free(s->table);
    PyMem_Free(s->queues);
    PyMem_Free(s->heap);
    PyMem_Free(s->p);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* One prompt (keys, counts, scale, now, decay), as the reference replay's loop body. */
static int
replay_prompt(ShadowCore *s, PyObject *prompt, double *score, double *interval)
{
    if (!PyTuple_Check(prompt) || PyTuple_GET_SIZE(prompt) != 5) {
        PyErr_SetString(PyExc_TypeError, "a prompt is a SampledPrompt (keys, counts, scale, now, decay)");
        return -1;
    }
    PyObject *keys = PySequence_Fast(PyTuple_GET_ITEM(prompt, 0), "keys must be a sequence");
    if (keys == NULL)
        return -1;
    PyObject *counts = PySequence_Fast(PyTuple_GET_ITEM(prompt, 1), "counts must be a sequence");
    if (counts == NULL) {
        Py_DECREF(keys);
        return -1;
    }
    double scale = PyFloat_AsDouble(PyTuple_GET_ITEM(prompt, 2));
    double now = PyFloat_AsDouble(PyTuple_GET_ITEM(prompt, 3));
    double decay = PyFloat_AsDouble(PyTuple_GET_ITEM(prompt, 4));
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    int status = -1;
    Py_hash_t *hashes = NULL;
    if (PyErr_Occurred())
        goto done;
    if (PySequence_Fast_GET_SIZE(counts) < n) {
        PyErr_SetString(PyExc_ValueError, "a prompt has fewer counts than keys");
        goto done;
    }
    hashes = PyMem_Malloc(sizeof(Py_hash_t) * (size_t)(n ? n : 1));
    if (hashes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        hashes[i] = PyObject_Hash(items[i]);
        if (hashes[i] == -1 && PyErr_Occurred())
            goto done;
    }
    long hits = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (find(s, hashes[i]) < 0)
            break;
        hits++;
    }
    *score = *score * decay + (double)hits;
    *interval += (double)hits;
    int ranked = s->weight > 0;
    long held = -1;
    int32_t queue = -1;
    for (Py_ssize_t i = n - 1; i >= 0; i--) { /* deeper pages first: they leave first on equal keys */
        long count = 0;
        if (ranked) {
            count = PyLong_AsLong(PySequence_Fast_GET_ITEM(counts, i));
            if (count == -1 && PyErr_Occurred())
                goto done;
            if (count < 0 || count >= s->p_len) {
                PyErr_SetString(PyExc_ValueError, "a count lies outside the curve");
                goto done;
            }
        }
        if (count != held) {
            held = count;
            queue = queue_of(s, scale, count);
            if (queue < 0)
                goto done;
        }
        int32_t e = find(s, hashes[i]);
        if (e >= 0 && s->entries[e].queue == queue) { /* a hit that stays in its queue: to its tail */
            unlink_entry(s, e);
            append_entry(s, e, queue);
            s->entries[e].touched = now;
            continue;
        }
        if (e >= 0)
            unlink_entry(s, e);
        if (!s->queues[queue].len) { /* a new head: its entry */
            HeapItem item = {now + credit(s, queue), ++s->serial, queue, hashes[i]};
            if (heap_push(s, item) < 0)
                goto done;
        }
        if (e < 0) {
            e = add_entry(s, hashes[i]);
            if (e < 0)
                goto done;
        }
        append_entry(s, e, queue);
        s->entries[e].touched = now;
    }
    status = 0;
done:
    PyMem_Free(hashes);
    Py_DECREF(keys);
    Py_DECREF(counts);
    return status;
}

static PyObject *
core_replay(ShadowCore *s, PyObject *args)
{
    PyObject *prompts_obj, *p;
    double score, interval;
    if (!PyArg_ParseTuple(args, "OOdd:replay", &prompts_obj, &p, &score, &interval))
        return NULL;
    if (s->busy) {
        PyErr_SetString(PyExc_RuntimeError, "replay called again from inside a replay (a key's __hash__ or __eq__?)");
        return NULL;
    }
    if (p != s->loaded_p) {
        if (load_curve(s, p) < 0)
            return NULL;
        Py_INCREF(p);
        Py_XSETREF(s->loaded_p, p);
    }
    PyObject *prompts = PySequence_Fast(prompts_obj, "prompts must be a sequence");
    if (prompts == NULL)
        return NULL;
    s->busy = 1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(prompts);
    int failed = 0;
    for (Py_ssize_t i = 0; i < n && !failed; i++)
        failed = replay_prompt(s, PySequence_Fast_GET_ITEM(prompts, i), &score, &interval) < 0;
    Py_DECREF(prompts);
    Py_ssize_t over = s->len - (s->capacity > 1 ? s->capacity : 1);
    if (!failed && over > 0)
        failed = evict(s, over, p) < 0;
    s->busy = 0;
    return failed ? NULL : Py_BuildValue("dd", score, interval);
}

/* [(scale, count, [(key's hash, touched), ...] in queue order), ...] in creation order (for tests). */
static PyObject *
core_queues(ShadowCore *s, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t q = 0; q < s->nqueues; q++) {
        PyObject *members = PyList_New(0);
        if (members == NULL)
            goto fail;
        for (int32_t e = s->queues[q].head; e >= 0; e = s->entries[e].next) {
            PyObject *pair = Py_BuildValue("(nd)", (Py_ssize_t)s->entries[e].hash, s->entries[e].touched);
            if (pair == NULL || PyList_Append(members, pair) < 0) {
                Py_XDECREF(pair);
                Py_DECREF(members);
                goto fail;
            }
            Py_DECREF(pair);
        }
        PyObject *row = Py_BuildValue("(dlN)", s->queues[q].scale, s->queues[q].count, members);
        if (row == NULL || PyList_Append(out, row) < 0) {
            Py_XDECREF(row);
            goto fail;
        }
        Py_DECREF(row);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static Py_ssize_t
core_len(ShadowCore *s)
{
    return s->len;
}

static PyMethodDef core_methods[] = {
    {"replay", (PyCFunction)core_replay, METH_VARARGS,
     "replay(prompts, p, score, interval_hits) -> (score, interval_hits); see pool.tuning.ShadowCache"},
    {"queues", (PyCFunction)core_queues, METH_NOARGS, "every queue's (scale, count, [(key, touched)]), in order"},
    {NULL, NULL, 0, NULL},
};

/* A new capacity applies at the next replay's eviction (as in the reference). */
static PyMemberDef core_members[] = {
    {"capacity", T_PYSSIZET, offsetof(ShadowCore, capacity), 0, "the keys kept after a replay (at least 1)"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods core_as_sequence = {.sq_length = (lenfunc)core_len};

static PyTypeObject ShadowCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpool_sidecar._shadow.ShadowCore",
    .tp_basicsize = sizeof(ShadowCore),
    .tp_dealloc = (destructor)core_dealloc,
    .tp_as_sequence = &core_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ShadowCore(capacity, weight): a shadow cache's keys, queues and heap (see _shadow.c)",
    .tp_methods = core_methods,
    .tp_members = core_members,
    .tp_new = core_new,
};

static struct PyModuleDef shadow_module = {
    PyModuleDef_HEAD_INIT, "_shadow", "A self-tuner's shadow cache, compiled.", -1, NULL,
};

PyMODINIT_FUNC
PyInit__shadow(void)
{
    if (PyType_Ready(&ShadowCoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&shadow_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ShadowCoreType);
    if (PyModule_AddObject(m, "ShadowCore", (PyObject *)&ShadowCoreType) < 0) {
        Py_DECREF(&ShadowCoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
