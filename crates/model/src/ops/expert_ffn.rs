//! One expert's FFN, y = act(x·W1 + b1)·W2 + b2, as GEMMs on the raw buffers plus one fused
//! elementwise pass, instead of a dozen candle nodes that each allocate, zero-fill and accumulate
//! activation-sized gradients. The activation is GELU (W1 d×f) or SwiGLU (W1 d×2f, its columns
//! the gate's then the up projection's; see [`super::swiglu`]).
//!
//! Weights come as four slices, [W1 (d×f₁), b1 (f₁), W2 (f×d), b2 (d)], wherever they live (a
//! stacked buffer or each expert's own tensors), and so do their gradients; a model without FFN
//! biases passes zeros (their gradients are computed and dropped: f₁ + d values an expert). The forward keeps its
//! pre-activation and activation (n×f each) for the backward, which recomputes them only if they
//! are gone. The autograd nodes are in [`super::grouped_ffn`] (one expert is a group of one); this
//! file holds the per-expert forward and backward they run.

use super::gelu::{gelu_grad_mul_f32, gelu_grad_mul_f64, gelu_slice_f32, gelu_slice_f64};
use super::gemm::gemm_rm;
use super::host::{add_row_sums, write_copy, zeroed, Unfilled};
use super::parallel::{map_slices_parallel, zip_slices_parallel};
use super::swiglu::{swiglu_bwd_f32, swiglu_bwd_f64, swiglu_fwd_f32, swiglu_fwd_f64};
use crate::config::Activation;
use std::mem::MaybeUninit;

macro_rules! expert_ffn_impl {
    ($fwd:ident, $bwd:ident, $t:ty, $gelu:ident, $gelu_grad:ident, $swiglu:ident, $swiglu_grad:ident) => {
        /// Writes y (n×d) into every slot of `y` and returns (h pre-activation n×f₁, a = act(h)
        /// n×f).
        #[allow(clippy::too_many_arguments)]
        pub(super) fn $fwd(
            x: &[$t],
            [w1, b1, w2, b2]: [&[$t]; 4],
            n: usize,
            d: usize,
            f: usize,
            act: Activation,
            y: &mut [MaybeUninit<$t>],
        ) -> (Vec<$t>, Vec<$t>) {
            let f1 = act.first_width(f);
            assert!(x.len() == n * d && y.len() == n * d && w1.len() == d * f1 && b1.len() == f1 && w2.len() == f * d && b2.len() == d);
            let mut h: Vec<$t> = Vec::with_capacity(n * f1);
            for _ in 0..n {
                h.extend_from_slice(b1);
            }
            // SAFETY: x is n×d, w1 is d×f₁, h is n×f₁; no aliasing.
            unsafe { gemm_rm(n, f1, d, h.as_mut_ptr(), true, (x.as_ptr(), d as isize, 1), (w1.as_ptr(), f1 as isize, 1), 1.0) };
            let a: Vec<$t> = match act {
                Activation::Gelu => map_slices_parallel(&h, $gelu),
                Activation::Swiglu => $swiglu(&h, f),
            };
            for row in y.chunks_exact_mut(d.max(1)) {
                write_copy(row, b2);
            }
            // SAFETY: a is n×f, w2 is f×d, y is n×d.
            unsafe { gemm_rm(n, d, f, y.as_mut_ptr().cast::<$t>(), true, (a.as_ptr(), f as isize, 1), (w2.as_ptr(), d as isize, 1), 1.0) };
            (h, a)
        }

        /// Gradients of x and of [W1, b1, W2, b2] from the output gradient g (n×d), written into
        /// every slot of `gx` (n×d) and `gw` (shaped as the weights), none of which is read, so
        /// they need no zero-fill (see [`Unfilled`](super::host::Unfilled)). `saved` is (h, a) from
        /// the forward when still at hand.
        #[allow(clippy::too_many_arguments)]
        pub(super) fn $bwd(
            x: &[$t],
            w: [&[$t]; 4],
            g: &[$t],
            n: usize,
            d: usize,
            f: usize,
            act: Activation,
            saved: Option<(Vec<$t>, Vec<$t>)>,
            gx: &mut [MaybeUninit<$t>],
            [gw1, gb1, gw2, gb2]: [&mut [MaybeUninit<$t>]; 4],
        ) {
            let [w1, _, w2, _] = w;
            let f1 = act.first_width(f);
            assert!(gx.len() == n * d && g.len() == n * d);
            assert!(gw1.len() == d * f1 && gb1.len() == f1 && gw2.len() == f * d && gb2.len() == d);
            if n == 0 || d == 0 || f == 0 {
                // No products to write them (the GEMMs below write every slot only for k > 0);
                // with no hidden units the output is b2 alone, whose gradient is still Σ_rows g.
                for s in [gx, gw1, gb1, gw2] {
                    zeroed(s);
                }
                add_row_sums(zeroed(gb2), g);
                return;
            }
            let (h, a) = match saved {
                Some((h, a)) if h.len() == n * f1 && a.len() == n * f => (h, a),
                _ => {
                    let mut y = Unfilled::<$t>::new(n * d);
                    $fwd(x, w, n, d, f, act, y.slots())
                }
            };
            // dW2 = aᵀ·g, db2 = Σ_rows g
            // SAFETY: aᵀ is f×n (row stride 1, column stride f), g is n×d, dst is f×d slots, every
            // one written (k = n > 0, no read of dst).
            unsafe {
                gemm_rm(f, d, n, gw2.as_mut_ptr().cast::<$t>(), false, (a.as_ptr(), 1, f as isize), (g.as_ptr(), d as isize, 1), 1.0)
            };
            add_row_sums(zeroed(gb2), g);
            // ga = g·W2ᵀ, then gh = ga ⊙ gelu'(h) (in place) or SwiGLU's backward (n×2f)
            let mut ga: Vec<$t> = Vec::with_capacity(n * f);
            // SAFETY: g is n×d, W2ᵀ is d×f (row stride 1, column stride d); ga has room for n×f,
            // every element of which the product writes (k = d > 0, no read of dst), before its
            // length is set.
            unsafe {
                gemm_rm(n, f, d, ga.as_mut_ptr(), false, (g.as_ptr(), d as isize, 1), (w2.as_ptr(), 1, d as isize), 1.0);
                ga.set_len(n * f);
            }
            let gh = match act {
                Activation::Gelu => {
                    zip_slices_parallel(&mut ga, &h, $gelu_grad);
                    ga
                }
                Activation::Swiglu => $swiglu_grad(&ga, &h, f),
            };
            // dW1 = xᵀ·gh, db1 = Σ_rows gh
            // SAFETY: xᵀ is d×n, gh is n×f₁, dst is d×f₁ slots, every one written (k = n > 0).
            unsafe {
                gemm_rm(d, f1, n, gw1.as_mut_ptr().cast::<$t>(), false, (x.as_ptr(), 1, d as isize), (gh.as_ptr(), f1 as isize, 1), 1.0)
            };
            add_row_sums(zeroed(gb1), &gh);
            // dx = gh·W1ᵀ
            // SAFETY: gh is n×f₁, W1ᵀ is f₁×d, dst is n×d slots, every one written (k = f₁ > 0).
            unsafe {
                gemm_rm(n, d, f1, gx.as_mut_ptr().cast::<$t>(), false, (gh.as_ptr(), f1 as isize, 1), (w1.as_ptr(), 1, f1 as isize), 1.0)
            };
        }
    };
}

expert_ffn_impl!(ffn_fwd_f32, ffn_bwd_f32, f32, gelu_slice_f32, gelu_grad_mul_f32, swiglu_fwd_f32, swiglu_bwd_f32);
expert_ffn_impl!(ffn_fwd_f64, ffn_bwd_f64, f64, gelu_slice_f64, gelu_grad_mul_f64, swiglu_fwd_f64, swiglu_bwd_f64);

#[cfg(test)]
mod tests {
    use super::super::gelu::gelu;
    use super::super::grouped_ffn::expert_ffn;
    use super::super::testing;
    use crate::config::Activation;
    use candle_core::{Tensor, Var};

    /// `ours` against `theirs` (the composite), forward and the gradients of every variable.
    fn assert_matches(ours: &Tensor, theirs: &Tensor, probe: &Var, vars: [&Var; 5]) {
        let diff = testing::max_diff;
        assert!(diff(ours, theirs) < 1e-12);
        let g1 = (ours * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (theirs * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        for v in vars {
            assert!(diff(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap()) < 1e-10);
        }
    }

    #[test]
    fn fused_expert_ffn_matches_composite_with_gradients() {
        let mut var = testing::vars(9, 0.5);
        let (x, w1, b1, w2, b2) = (var(&[7, 5]), var(&[5, 6]), var(&[6]), var(&[6, 5]), var(&[5]));
        let probe = var(&[7, 5]);
        let ours = expert_ffn(x.as_tensor(), w1.as_tensor(), b1.as_tensor(), w2.as_tensor(), b2.as_tensor(), Activation::Gelu).unwrap();
        let h = x.as_tensor().matmul(w1.as_tensor()).unwrap().broadcast_add(b1.as_tensor()).unwrap();
        let theirs = gelu(&h).unwrap().matmul(w2.as_tensor()).unwrap().broadcast_add(b2.as_tensor()).unwrap();
        assert_matches(&ours, &theirs, &probe, [&x, &w1, &b1, &w2, &b2]);
    }

    /// The SwiGLU expert against its composite, SiLU(x·W_gate + b_gate) ⊙ (x·W_up + b_up)·W2 + b2
    /// from candle's ops (W1 = [W_gate | W_up]), forward and every gradient.
    #[test]
    fn fused_swiglu_expert_matches_composite_with_gradients() {
        let mut var = testing::vars(10, 0.5);
        let (n, d, f) = (9, 5, 4);
        let (x, w1, b1, w2, b2) = (var(&[n, d]), var(&[d, 2 * f]), var(&[2 * f]), var(&[f, d]), var(&[d]));
        let probe = var(&[n, d]);
        let ours = expert_ffn(x.as_tensor(), w1.as_tensor(), b1.as_tensor(), w2.as_tensor(), b2.as_tensor(), Activation::Swiglu).unwrap();
        let h = x.as_tensor().matmul(w1.as_tensor()).unwrap().broadcast_add(b1.as_tensor()).unwrap();
        let a = (h.narrow(1, 0, f).unwrap().silu().unwrap() * h.narrow(1, f, f).unwrap()).unwrap();
        let theirs = a.matmul(w2.as_tensor()).unwrap().broadcast_add(b2.as_tensor()).unwrap();
        assert_matches(&ours, &theirs, &probe, [&x, &w1, &b1, &w2, &b2]);
    }
}
