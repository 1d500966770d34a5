//! Matrix products through cuBLASLt with one algorithm per *shape class*, chosen once.
//!
//! Why: cuBLAS picks a kernel for every new problem shape (its heuristics cache is keyed by the
//! exact sizes), and an MoE layer's expert products change shape every step — each expert gets a
//! different number of rows. On an H100 that choice cost ~150 µs of host time per bf16 product,
//! so the experts of a small model were bound by it (12.6 ms of host time for 64 products a
//! step). Here a product's class is its types, transpositions, pointer alignment and each size
//! rounded up to a power of two; the first product of a class asks cuBLASLt's heuristic for the
//! class's largest problem and every later product of the class reuses that algorithm (a kernel
//! configuration valid for any smaller size of the same layout). A class whose algorithm cuBLASLt
//! refuses falls back to `cublasGemmEx`.
//!
//! `LAZARUS_GEMM=ex` turns this off (every product through `cublasGemmEx`): the "before" of the
//! benchmarks.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr};
use candle_core::cuda_backend::CudaDevice;
use lazarus_kernels::{Dtype, Gemm};

/// Whether products go through cuBLASLt (`LAZARUS_GEMM` is not `ex`; read once per process).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("LAZARUS_GEMM").map_or(true, |v| v != "ex"))
}

/// What fixes a product's algorithm: the element types, the transpositions, the pointers' and
/// leading dimensions' common alignment, and m, n, k rounded up to powers of two.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Class {
    ab: Dtype,
    c: Dtype,
    trans_a: bool,
    trans_b: bool,
    align: u32,
    m: usize,
    n: usize,
    k: usize,
}

impl Class {
    fn of(g: &Gemm) -> Class {
        let size = g.ab.size() as u64;
        let c_size = g.c.size() as u64;
        let bytes = [g.a, g.b, g.cptr, g.lda as u64 * size, g.ldb as u64 * size, g.ldc as u64 * c_size];
        let align = bytes.iter().map(|&x| if x == 0 { 256 } else { 1u64 << x.trailing_zeros().min(8) }).min().unwrap_or(256) as u32;
        Class {
            ab: g.ab,
            c: g.c,
            trans_a: g.trans_a,
            trans_b: g.trans_b,
            align,
            m: g.m.next_power_of_two(),
            n: g.n.next_power_of_two(),
            k: g.k.next_power_of_two(),
        }
    }
}

fn cuda_type(d: Dtype) -> sys::cudaDataType {
    match d {
        Dtype::F32 => sys::cudaDataType::CUDA_R_32F,
        Dtype::F64 => sys::cudaDataType::CUDA_R_64F,
        Dtype::Bf16 => sys::cudaDataType::CUDA_R_16BF,
    }
}

/// cuBLAS's operation enum (cuBLASLt's TRANSA/TRANSB attributes take it as an int32).
fn op(t: bool) -> i32 {
    use candle_core::cuda_backend::cudarc::cublas::sys::cublasOperation_t as Op;
    (if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N }) as i32
}

/// The three column-major layouts of a row-major product C [m, n] = op(A) · op(B), computed as
/// Cᵀ = op(B)ᵀ · op(A)ᵀ: cuBLASLt's A is our B (n × k, or k × n transposed), its B our A, its
/// C and D our C (n × m). Destroyed on drop.
struct Layouts([sys::cublasLtMatrixLayout_t; 3]);

impl Layouts {
    /// Layouts for sizes (m, n, k) and leading dimensions (lda, ldb, ldc) of `g`'s types.
    fn new(g: &Gemm, (m, n, k): (usize, usize, usize), (lda, ldb, ldc): (usize, usize, usize)) -> Result<Layouts, lt::CublasError> {
        let (lt_a_rows, lt_a_cols) = if g.trans_b { (k, n) } else { (n, k) };
        let (lt_b_rows, lt_b_cols) = if g.trans_a { (m, k) } else { (k, m) };
        let a = lt::create_matrix_layout(cuda_type(g.ab), lt_a_rows as u64, lt_a_cols as u64, ldb as i64)?;
        let b = lt::create_matrix_layout(cuda_type(g.ab), lt_b_rows as u64, lt_b_cols as u64, lda as i64).inspect_err(|_| {
            // SAFETY: created just above, destroyed once.
            unsafe { lt::destroy_matrix_layout(a).ok() };
        })?;
        let c = lt::create_matrix_layout(cuda_type(g.c), n as u64, m as u64, ldc as i64).inspect_err(|_| {
            // SAFETY: created just above, destroyed once.
            unsafe {
                lt::destroy_matrix_layout(a).ok();
                lt::destroy_matrix_layout(b).ok();
            }
        })?;
        Ok(Layouts([a, b, c]))
    }
}

impl Drop for Layouts {
    fn drop(&mut self) {
        for l in self.0 {
            // SAFETY: each layout was created by `new` and is destroyed once, here.
            unsafe { lt::destroy_matrix_layout(l).ok() };
        }
    }
}

/// cuBLASLt state of one GPU: its handle, a workspace, the matmul descriptors by (types,
/// transpositions) and the algorithm of each class (None: cuBLASLt has none, use GemmEx).
struct Device {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    descs: HashMap<(bool, bool, bool), sys::cublasLtMatmulDesc_t>,
    algos: HashMap<Class, Option<sys::cublasLtMatmulAlgo_t>>,
}

// SAFETY: the handle and descriptors are only used under the mutex that holds them.
unsafe impl Send for Device {}

/// Workspace bytes cuBLASLt may use (what cudarc gives Hopper; split-K kernels want it).
const WORKSPACE: usize = 32 << 20;

fn devices() -> &'static Mutex<HashMap<usize, Device>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(HashMap::new()))
}

fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt {what}: {e:?}"))
}

impl Device {
    fn open(dev: &CudaDevice) -> candle_core::Result<Device> {
        let handle = lt::create_handle().map_err(|e| err("handle", e))?;
        // SAFETY: a scratch buffer only cuBLASLt writes.
        let workspace = unsafe { dev.alloc::<u8>(WORKSPACE)? };
        Ok(Device { handle, workspace, descs: HashMap::new(), algos: HashMap::new() })
    }

    /// The matmul descriptor of f32 compute (f64 for f64) with these transpositions.
    fn desc(&mut self, g: &Gemm) -> Result<sys::cublasLtMatmulDesc_t, lt::CublasError> {
        let key = (g.ab == Dtype::F64, g.trans_a, g.trans_b);
        if let Some(&d) = self.descs.get(&key) {
            return Ok(d);
        }
        let (compute, scale) = if g.ab == Dtype::F64 {
            (sys::cublasComputeType_t::CUBLAS_COMPUTE_64F, sys::cudaDataType::CUDA_R_64F)
        } else {
            (sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)
        };
        let d = lt::create_matmul_desc(compute, scale)?;
        // cuBLASLt's A is our B and its B our A (see `Layouts`).
        for (attr, t) in [
            (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, g.trans_b),
            (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, g.trans_a),
        ] {
            let v = op(t);
            // SAFETY: the descriptor was just created; the attribute is an int32.
            unsafe { lt::set_matmul_desc_attribute(d, attr, &v as *const i32 as *const c_void, std::mem::size_of::<i32>())? };
        }
        self.descs.insert(key, d);
        Ok(d)
    }

    /// The algorithm of `g`'s class: cuBLASLt's heuristic for the class's largest problem, asked
    /// once.
    fn algo(&mut self, g: &Gemm, class: Class) -> Result<Option<sys::cublasLtMatmulAlgo_t>, lt::CublasError> {
        if let Some(a) = self.algos.get(&class) {
            return Ok(*a);
        }
        let desc = self.desc(g)?;
        // The class's largest problem with leading dimensions that hold it (and keep the
        // alignment: every size here is a power of two at least as large as the real one).
        let (m, n, k) = (class.m, class.n, class.k);
        let lda = if g.trans_a { m } else { k }.max(g.lda);
        let ldb = if g.trans_b { k } else { n }.max(g.ldb);
        let ldc = n.max(g.ldc);
        let layouts = Layouts::new(g, (m, n, k), (lda, ldb, ldc))?;
        let pref = lt::create_matmul_pref()?;
        let bytes = WORKSPACE as u64;
        let align = class.align;
        let set = |attr, v: *const c_void, size| -> Result<(), lt::CublasError> {
            // SAFETY: the preference was just created; sizes match the attributes' types.
            unsafe { lt::set_matmul_pref_attribute(pref, attr, v, size) }
        };
        let r = (|| {
            set(
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &bytes as *const u64 as *const c_void,
                8,
            )?;
            for attr in [
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ] {
                set(attr, &align as *const u32 as *const c_void, 4)?;
            }
            let [a, b, c] = layouts.0;
            // SAFETY: live handle, descriptor, layouts and preference.
            unsafe { lt::get_matmul_algo_heuristic(self.handle, desc, a, b, c, c, pref) }
        })();
        // SAFETY: created above, destroyed once.
        unsafe { lt::destroy_matmul_pref(pref).ok() };
        let algo = match r {
            Ok(h) if h.workspaceSize <= WORKSPACE => Some(h.algo),
            Ok(_) => None,
            Err(e) if e.0 == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => None,
            Err(e) => return Err(e),
        };
        self.algos.insert(class, algo);
        Ok(algo)
    }
}

/// C = α·op(A)·op(B) + β·C through cuBLASLt with its class's algorithm. Ok(false): the class has
/// no cuBLASLt algorithm (the caller uses GemmEx).
///
/// # Safety
/// `g` was checked (`Gemm::check`) and its addresses hold its matrices on `dev`.
pub unsafe fn gemm(dev: &CudaDevice, ordinal: usize, g: &Gemm) -> candle_core::Result<bool> {
    let class = Class::of(g);
    let mut all = devices().lock().map_err(|_| candle_core::Error::Msg("cuBLASLt: poisoned".into()))?;
    let d = match all.entry(ordinal) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(Device::open(dev)?),
    };
    let Some(algo) = d.algo(g, class).map_err(|e| err("heuristic", e))? else { return Ok(false) };
    let desc = d.desc(g).map_err(|e| err("descriptor", e))?;
    let layouts = Layouts::new(g, (g.m, g.n, g.k), (g.lda, g.ldb, g.ldc)).map_err(|e| err("layout", e))?;
    let [la, lb, lc] = layouts.0;
    let (a32, b32) = (g.alpha as f32, g.beta as f32);
    let (alpha, beta) = if g.ab == Dtype::F64 {
        (&g.alpha as *const f64 as *const c_void, &g.beta as *const f64 as *const c_void)
    } else {
        (&a32 as *const f32 as *const c_void, &b32 as *const f32 as *const c_void)
    };
    let stream = dev.cuda_stream();
    let (ws, _guard) = d.workspace.device_ptr(&stream);
    // SAFETY: the caller's contract for the matrices; the workspace is this device's, of
    // WORKSPACE bytes; alpha and beta outlive the call; cuBLASLt's A is our B (see `Layouts`).
    let r = unsafe {
        lt::matmul(
            d.handle,
            desc,
            alpha,
            beta,
            g.b as *const c_void,
            la,
            g.a as *const c_void,
            lb,
            g.cptr as *const c_void,
            lc,
            g.cptr as *mut c_void,
            lc,
            &algo,
            ws as *mut c_void,
            WORKSPACE,
            stream.cu_stream() as sys::cudaStream_t,
        )
    };
    match r {
        Ok(()) => Ok(true),
        // The class's algorithm does not take this member of the class: GemmEx for it.
        Err(e) if matches!(e.0, sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED | sys::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE) => {
            Ok(false)
        }
        Err(e) => Err(err(&format!("matmul {g:?}"), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_class_rounds_sizes_up_and_keeps_the_alignment() {
        let g = Gemm { lda: 1024, ..Gemm::plain(Dtype::Bf16, Dtype::F32, 300, 4096, 1024, 0x1000, 0x2000, 0x3000) };
        let c = Class::of(&g);
        assert_eq!((c.m, c.n, c.k), (512, 4096, 1024));
        assert_eq!(c.align, 256);
        // Two experts' row counts in one class; a row offset of 8 bf16 elements makes 16 bytes.
        let h = Gemm { a: 0x1000 + 16, ..Gemm::plain(Dtype::Bf16, Dtype::F32, 257, 4096, 1024, 0x1000, 0x2000, 0x3000) };
        assert_eq!(Class::of(&h).m, 512);
        assert_eq!(Class::of(&h).align, 16);
        assert_ne!(Class::of(&h), c);
    }
}
