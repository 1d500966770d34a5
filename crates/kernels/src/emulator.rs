//! The kernels on the CPU: a [`Device`] whose memory is host memory and whose launches run under
//! the emulator (`emulator/emulate.cpp`), its matrix products a plain triple loop. For tests:
//! every kernel and op checked against its reference on a machine without a GPU, with the same
//! buffers and launches the GPU gets.

use std::ffi::{c_char, c_void, CString};

use crate::{Device, Dtype, Elem, Gemm, KernelError, Launch};

extern "C" {
    fn lazarus_emu_launch(
        name: *const c_char,
        grid: *const u32,
        block: *const u32,
        shared_bytes: u32,
        args: *mut *mut c_void,
        sizes: *const u32,
        nargs: u32,
        reverse: i32,
        err: *mut c_char,
        errlen: u32,
    ) -> i32;
}

/// Runs launches on the CPU. Between two barriers a block's threads run one at a time, first to
/// last or, `reverse`, last to first: a kernel whose result depends on the order has a missing
/// barrier (run a test both ways).
#[derive(Debug, Clone, Copy, Default)]
pub struct Emulator {
    pub reverse: bool,
}

/// Host memory standing in for a device buffer: 16-byte aligned (as a GPU allocation is, at
/// least, so that kernels' 16-byte vector loads find the alignment they would on the device),
/// `bytes` long.
#[derive(Debug, Clone)]
pub struct HostBuffer {
    words: Vec<Words>,
    bytes: usize,
}

/// Two u64 at a 16-byte boundary.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(16))]
struct Words([u64; 2]);

impl HostBuffer {
    /// `n` elements of `elem`, every byte 0xFF (a NaN in every float type; u32::MAX): an element
    /// an op leaves unwritten shows.
    pub fn poisoned(elem: Elem, n: usize) -> Self {
        let bytes = n * elem.size();
        HostBuffer { words: vec![Words([u64::MAX; 2]); bytes.div_ceil(16)], bytes }
    }

    /// The buffer's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: the words hold at least `bytes` initialised bytes; u8 has no alignment.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.bytes) }
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.bytes) }
    }

    /// Floats of `dt` from f64 values (bf16 rounded to nearest even).
    pub fn from_f64(dt: Dtype, v: &[f64]) -> Self {
        let mut b = HostBuffer::poisoned(Elem::Float(dt), v.len());
        for (i, &x) in v.iter().enumerate() {
            // SAFETY: i < len elements of dt.
            unsafe { write_float(b.as_bytes_mut().as_mut_ptr() as u64, dt, i, x) };
        }
        b
    }

    /// The buffer's floats of `dt`, as f64.
    pub fn to_f64(&self, dt: Dtype) -> Vec<f64> {
        let n = self.bytes / dt.size();
        // SAFETY: i < n elements of dt within the buffer.
        (0..n).map(|i| unsafe { read_float(self.as_bytes().as_ptr() as u64, dt, i) }).collect()
    }

    /// u32 values.
    pub fn from_u32(v: &[u32]) -> Self {
        let mut b = HostBuffer::poisoned(Elem::U32, v.len());
        for (chunk, x) in b.as_bytes_mut().chunks_exact_mut(4).zip(v) {
            chunk.copy_from_slice(&x.to_le_bytes());
        }
        b
    }

    /// u64 values.
    pub fn from_u64(v: &[u64]) -> Self {
        let mut b = HostBuffer::poisoned(Elem::U64, v.len());
        for (chunk, x) in b.as_bytes_mut().chunks_exact_mut(8).zip(v) {
            chunk.copy_from_slice(&x.to_le_bytes());
        }
        b
    }

    /// The buffer's address.
    pub fn addr(&self) -> u64 {
        self.words.as_ptr() as u64
    }
}

/// bf16 of f32 `x`, rounded to nearest even (a NaN stays a NaN).
pub fn bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// Element `i` of the `dt` array at `at`, as f64.
///
/// # Safety
/// `at` addresses at least i + 1 elements of `dt`.
unsafe fn read_float(at: u64, dt: Dtype, i: usize) -> f64 {
    // SAFETY: forwarded from the caller (unaligned reads: host buffers of any origin).
    unsafe {
        match dt {
            Dtype::F32 => ((at as *const f32).add(i)).read_unaligned() as f64,
            Dtype::F64 => ((at as *const f64).add(i)).read_unaligned(),
            Dtype::Bf16 => f32::from_bits((((at as *const u16).add(i)).read_unaligned() as u32) << 16) as f64,
        }
    }
}

/// Write `x` as element `i` of the `dt` array at `at`.
///
/// # Safety
/// `at` addresses at least i + 1 writable elements of `dt`.
unsafe fn write_float(at: u64, dt: Dtype, i: usize, x: f64) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match dt {
            Dtype::F32 => ((at as *mut f32).add(i)).write_unaligned(x as f32),
            Dtype::F64 => ((at as *mut f64).add(i)).write_unaligned(x),
            Dtype::Bf16 => ((at as *mut u16).add(i)).write_unaligned(bf16_bits(x as f32)),
        }
    }
}

impl Device for Emulator {
    type Buffer = HostBuffer;
    type Error = EmulatorError;

    fn alloc(&self, elem: Elem, n: usize) -> Result<HostBuffer, EmulatorError> {
        Ok(HostBuffer::poisoned(elem, n))
    }

    fn zeros(&self, elem: Elem, n: usize) -> Result<HostBuffer, EmulatorError> {
        let bytes = n * elem.size();
        Ok(HostBuffer { words: vec![Words([0; 2]); bytes.div_ceil(16)], bytes })
    }

    fn upload_u32(&self, v: &[u32]) -> Result<HostBuffer, EmulatorError> {
        Ok(HostBuffer::from_u32(v))
    }

    fn upload_u64(&self, v: &[u64]) -> Result<HostBuffer, EmulatorError> {
        Ok(HostBuffer::from_u64(v))
    }

    fn addr(&self, b: &HostBuffer) -> u64 {
        b.addr()
    }

    /// # Safety
    /// As [`Device::launch`]: every pointer argument addresses host memory the kernel may read
    /// and write as its builder documents.
    unsafe fn launch(&self, l: &Launch) -> Result<(), EmulatorError> {
        let name = CString::new(l.kernel.as_str()).map_err(|_| EmulatorError::Launch(format!("kernel name {:?}", l.kernel)))?;
        let mut values: Vec<[u8; 8]> = Vec::with_capacity(l.args.len());
        let mut sizes: Vec<u32> = Vec::with_capacity(l.args.len());
        for a in &l.args {
            let (bytes, n) = a.bytes();
            values.push(bytes);
            sizes.push(n as u32);
        }
        let mut ptrs: Vec<*mut c_void> = values.iter_mut().map(|v| v.as_mut_ptr().cast::<c_void>()).collect();
        let mut err = vec![0u8; 512];
        // SAFETY: the strings, arrays and argument values outlive the call; what the kernel does
        // with the addresses is the caller's contract.
        let rc = unsafe {
            lazarus_emu_launch(
                name.as_ptr(),
                l.grid.as_ptr(),
                l.block.as_ptr(),
                l.shared_bytes,
                ptrs.as_mut_ptr(),
                sizes.as_ptr(),
                ptrs.len() as u32,
                i32::from(self.reverse),
                err.as_mut_ptr().cast::<c_char>(),
                err.len() as u32,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
        Err(EmulatorError::Launch(String::from_utf8_lossy(&err[..end]).into_owned()))
    }

    /// The product by definition, each output summed in f64 in k order, then rounded to C's type.
    ///
    /// # Safety
    /// As [`Device::gemm`].
    unsafe fn gemm(&self, g: &Gemm) -> Result<(), EmulatorError> {
        g.check()?;
        for i in 0..g.m {
            for j in 0..g.n {
                let mut acc = 0.0f64;
                for p in 0..g.k {
                    let ai = if g.trans_a { p * g.lda + i } else { i * g.lda + p };
                    let bi = if g.trans_b { j * g.ldb + p } else { p * g.ldb + j };
                    // SAFETY: indices within the matrices the caller describes.
                    acc += unsafe { read_float(g.a, g.ab, ai) * read_float(g.b, g.ab, bi) };
                }
                let ci = i * g.ldc + j;
                // SAFETY: as above; beta 0 does not read C (it may hold anything, NaN included).
                let old = if g.beta == 0.0 { 0.0 } else { g.beta * unsafe { read_float(g.cptr, g.c, ci) } };
                unsafe { write_float(g.cptr, g.c, ci, g.alpha * acc + old) };
            }
        }
        Ok(())
    }
}

/// What the emulator refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EmulatorError {
    #[error("emulated launch: {0}")]
    Launch(String),
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Arg;

    #[test]
    fn a_launch_that_does_not_fit_its_kernel_is_an_error() {
        let e = Emulator::default();
        let x = HostBuffer::from_f64(Dtype::F32, &[1.0; 4]);
        let y = HostBuffer::poisoned(Elem::Float(Dtype::F32), 4);
        let mut l = crate::gelu(Dtype::F32, x.addr(), y.addr(), 4);
        l.args[2] = Arg::U32(4);
        // SAFETY: 4 elements each.
        let err = unsafe { e.launch(&l) }.unwrap_err().to_string();
        assert!(err.contains("argument 2 has 4 bytes, the parameter 8"), "{err}");
        l.args.pop();
        assert!(unsafe { e.launch(&l) }.unwrap_err().to_string().contains("2 arguments for 3 parameters"));
        l.kernel = "no_such_kernel".into();
        assert!(unsafe { e.launch(&l) }.unwrap_err().to_string().contains("no kernel named no_such_kernel"));
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to the even one, 1.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(f32::from_bits((bf16_bits(f32::NAN) as u32) << 16).is_nan());
    }

    #[test]
    fn the_emulated_product_follows_the_row_major_definition() {
        let e = Emulator::default();
        // A = [[1, 2, 3], [4, 5, 6]] (2×3), B = Aᵀ stored as A: C = A·Aᵀ = [[14, 32], [32, 77]].
        let a = HostBuffer::from_f64(Dtype::F64, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let c = HostBuffer::poisoned(Elem::Float(Dtype::F64), 4);
        let g = Gemm { trans_b: true, ldb: 3, ldc: 2, ..Gemm::plain(Dtype::F64, Dtype::F64, 2, 2, 3, a.addr(), a.addr(), c.addr()) };
        // SAFETY: the buffers hold the matrices.
        unsafe { e.gemm(&g) }.unwrap();
        assert_eq!(c.to_f64(Dtype::F64), vec![14.0, 32.0, 32.0, 77.0]);
        // Aᵀ·A (3×3) through trans_a, accumulated onto itself (beta 1) twice.
        let c = HostBuffer::from_f64(Dtype::F64, &[0.0; 9]);
        let g = Gemm { trans_a: true, lda: 3, beta: 1.0, ..Gemm::plain(Dtype::F64, Dtype::F64, 3, 3, 2, a.addr(), a.addr(), c.addr()) };
        unsafe {
            e.gemm(&g).unwrap();
            e.gemm(&g).unwrap()
        };
        assert_eq!(c.to_f64(Dtype::F64)[..3], [34.0, 44.0, 54.0]);
    }
}
