//! Scalar f32 math written so that a loop over it vectorizes (no libm calls), and the run-time
//! check for the AVX2+FMA builds of such loops. Shared by the GELU and the attention softmax.

/// e^x for f32 without a libm call, so that a loop over it vectorizes: x = n·ln2 + r with
/// |r| ≤ ln2/2, e^r by Cephes' expf polynomial, 2^n built in the exponent bits. Relative error
/// within a few ulp over the whole range; x is clamped to [−87.3, 88] (e^x stays a normal
/// float), NaN stays NaN.
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and taking away 1.5·2²³ rounds to the nearest integer in the default rounding mode.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1) * r + 0.5;
    let er = p * r * r + r + 1.0;
    er * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Whether the CPU has AVX2 and FMA, for the `#[target_feature]` builds of the f32 loops (checked
/// once).
pub(super) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// v ← exp(v − max v) / Σ exp(v − max v) in place: one row of a softmax, with eight partial
/// sums and maxima so that every pass vectorizes.
#[inline(always)]
fn softmax_row_loop(v: &mut [f32]) {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        lanes.iter_mut().zip(c).for_each(|(m, &x)| *m = m.max(x));
    }
    let max = chunks.remainder().iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let mut sums = [0f32; 8];
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        sums.iter_mut().zip(c).for_each(|(s, x)| {
            *x = exp_f32(*x - max);
            *s += *x;
        });
    }
    let mut sum = 0f32;
    for x in chunks.into_remainder() {
        *x = exp_f32(*x - max);
        sum += *x;
    }
    let inv = 1.0 / (sum + sums.iter().sum::<f32>());
    v.iter_mut().for_each(|x| *x *= inv);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn softmax_row_avx2(v: &mut [f32]) {
    softmax_row_loop(v)
}

/// Softmax of one row in place (f32, vectorized; AVX2+FMA where the CPU has them).
pub(super) fn softmax_row_f32(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { softmax_row_avx2(v) };
    }
    softmax_row_loop(v)
}

/// Softmax of one row in place (f64, libm's exp: the reference precision).
pub(super) fn softmax_row_f64(v: &mut [f64]) {
    let max = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0.0;
    for x in v.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    v.iter_mut().for_each(|x| *x *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized softmax row against the f64 one, on both code paths, for lengths around
    /// the eight-lane chunks, and a NaN score making the row NaN (a diverged step is still caught).
    #[test]
    fn f32_softmax_row_matches_f64() {
        for n in [1, 7, 8, 9, 31, 128] {
            let xs: Vec<f64> = (0..n).map(|i| ((i * 37 % 11) as f64 - 5.0) * 1.7).collect();
            let mut want = xs.clone();
            softmax_row_f64(&mut want);
            let paths: [fn(&mut [f32]); 2] = [softmax_row_f32, softmax_row_loop];
            for f in paths {
                let mut v: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
                f(&mut v);
                for (a, b) in v.iter().zip(&want) {
                    assert!((*a as f64 - b).abs() <= 1e-6 * b.max(1e-3), "n {n}: {a} vs {b}");
                }
            }
        }
        let mut v = vec![0.0, f32::NAN, 1.0];
        softmax_row_f32(&mut v);
        assert!(v.iter().all(|x| x.is_nan()));
    }
}
