//! What the two wire forms of training state share ([`crate::ExpertState`], one expert;
//! [`crate::SharedState`], the replicated rest): after a header of their own, a table of
//! tensors — per tensor its rank (u32), its dimensions (u64 each) and its AdamW step (u64) —
//! then per tensor its weight, m and v as little-endian f32. A decoder is told the shapes it
//! expects and checks the whole length before it reads anything, so a peer cannot make it
//! allocate more than it asked for; [`Reader`] then reads within that length.

use crate::error::RuntimeError;

/// One tensor with its optimizer state: of an expert, or of the replicated rest.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorTrainState {
    pub shape: Vec<usize>,
    pub weight: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// AdamW updates applied to this tensor.
    pub step: u64,
}

/// The shape of each of `tensors`.
pub(crate) fn shapes_of(tensors: &[TensorTrainState]) -> Vec<Vec<usize>> {
    tensors.iter().map(|t| t.shape.clone()).collect()
}

/// Bytes of the table and values of tensors of these shapes.
pub(crate) fn tensors_len(shapes: &[Vec<usize>]) -> usize {
    shapes.iter().map(|s| 4 + 8 * s.len() + 8 + 3 * 4 * s.iter().product::<usize>()).sum()
}

/// The table, then the values, of `tensors`.
pub(crate) fn put_tensors(out: &mut Vec<u8>, tensors: &[TensorTrainState]) {
    put_table(out, tensors.iter().map(|t| (t.shape.as_slice(), t.step)));
    for t in tensors {
        for part in [&t.weight, &t.m, &t.v] {
            put_values(out, part);
        }
    }
}

/// Per tensor: its rank (u32), dimensions (u64 each) and AdamW step (u64).
pub(crate) fn put_table<'a>(out: &mut Vec<u8>, tensors: impl Iterator<Item = (&'a [usize], u64)>) {
    for (shape, step) in tensors {
        out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
        for &d in shape {
            out.extend_from_slice(&(d as u64).to_le_bytes());
        }
        out.extend_from_slice(&step.to_le_bytes());
    }
}

/// Values as little-endian f32: one copy (a plain memcpy on little-endian machines).
pub(crate) fn put_values(out: &mut Vec<u8>, values: &[f32]) {
    out.extend_from_slice(&lazarus_comm::f32_wire(values));
}

/// Reads a wire form whose length its caller checked against the shapes it expects: every
/// read stays within it.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8], at: usize) -> Self {
        Reader { bytes, at }
    }

    /// A reader of `bytes` past their magic, once they are `want` bytes long (what the shapes
    /// expected make) and begin with `magic`; `bad` says what is wrong otherwise.
    pub(crate) fn checked(bytes: &'a [u8], want: usize, magic: u32, bad: impl Fn(String) -> RuntimeError) -> Result<Self, RuntimeError> {
        if bytes.len() != want {
            return Err(bad(format!("{} bytes, expected {want}", bytes.len())));
        }
        let mut r = Reader::new(bytes, 0);
        match r.u32() {
            m if m == magic => Ok(r),
            m => Err(bad(format!("bad magic {m:#x}"))),
        }
    }

    /// Where the next read begins.
    pub(crate) fn at(&self) -> usize {
        self.at
    }

    fn take(&mut self, n: usize) -> &'a [u8] {
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        s
    }

    pub(crate) fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().expect("4 bytes"))
    }

    pub(crate) fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().expect("8 bytes"))
    }

    fn f32s(&mut self, n: usize) -> Vec<f32> {
        self.take(4 * n).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// The table of tensors that must have `shapes`: each one's AdamW step. A rank that differs
    /// would misplace what follows even though the length matched, so each is checked.
    pub(crate) fn table(&mut self, shapes: &[Vec<usize>], bad: impl Fn(String) -> RuntimeError) -> Result<Vec<u64>, RuntimeError> {
        let mut steps = Vec::with_capacity(shapes.len());
        for (k, shape) in shapes.iter().enumerate() {
            let rank = self.u32() as usize;
            if rank != shape.len() {
                return Err(bad(format!("tensor {k} has rank {rank}, expected {}", shape.len())));
            }
            for (i, &d) in shape.iter().enumerate() {
                let got = self.u64();
                if got != d as u64 {
                    return Err(bad(format!("tensor {k} dimension {i} is {got}, expected {d}")));
                }
            }
            steps.push(self.u64());
        }
        Ok(steps)
    }

    /// The values of tensors of `shapes` whose table gave `steps`.
    pub(crate) fn tensors(&mut self, shapes: &[Vec<usize>], steps: &[u64]) -> Vec<TensorTrainState> {
        shapes
            .iter()
            .zip(steps)
            .map(|(shape, &step)| {
                let n = shape.iter().product();
                let (weight, m, v) = (self.f32s(n), self.f32s(n), self.f32s(n));
                TensorTrainState { shape: shape.clone(), weight, m, v, step }
            })
            .collect()
    }
}

/// What the tests of both wire forms make and check.
#[cfg(test)]
pub(crate) mod testing {
    use super::TensorTrainState;

    /// Tensors of `shapes` whose values count up by `by` from it (weights, then m, then v, tensor
    /// by tensor), the k-th at AdamW step `first_step + k`.
    pub(crate) fn counting(shapes: &[Vec<usize>], by: f32, first_step: u64) -> Vec<TensorTrainState> {
        let mut x = 0.0f32;
        let mut next = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    x += by;
                    x
                })
                .collect()
        };
        (0..shapes.len())
            .map(|k| {
                let n = shapes[k].iter().product();
                TensorTrainState { shape: shapes[k].clone(), weight: next(n), m: next(n), v: next(n), step: first_step + k as u64 }
            })
            .collect()
    }

    /// `decode` given every byte of `bytes` flipped three ways, and every prefix: it must return
    /// (an error, never a panic).
    pub(crate) fn damaged_never_panic(bytes: &[u8], decode: impl Fn(&[u8])) {
        for i in 0..bytes.len() {
            for flip in [1u8, 0x80, 0xff] {
                let mut b = bytes.to_vec();
                b[i] ^= flip;
                decode(&b);
            }
            decode(&bytes[..i]);
        }
    }
}
