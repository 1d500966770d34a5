//! Router decisions that are not differentiable: top-k selection and trace-driven assignment.

use crate::error::{ModelError, Result};
use candle_core::Tensor;

/// The weight of each of a token's k choices [n, k], in the graph of `probs` [n, E] (the router's
/// softmax over all experts): the chosen probabilities, divided by their sum when `normalize` and
/// k > 1 (Mixtral, GShard), as they are otherwise (Qwen-MoE's default, OLMoE; a single choice
/// always, so that the loss reaches the router). The one home of this rule: the single-process
/// layer and the distributed one both weight by it.
pub fn combine_weights(probs: &Tensor, choices: &[u32], n: usize, k: usize, normalize: bool) -> candle_core::Result<Tensor> {
    let idx = Tensor::from_vec(choices.to_vec(), (n, k), probs.device())?;
    let w = probs.gather(&idx, 1)?;
    if normalize && k > 1 {
        return w.broadcast_div(&w.sum_keepdim(1)?);
    }
    Ok(w)
}

/// Indices of the k largest values (ties to the lower index), largest first.
pub fn top_k(row: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// [`top_k`] of every row of `width` probabilities (row-major): n·k expert ids, token-major. The
/// rows go over the cores (a serial sort per token was ~1 ms a step on the calling thread).
pub fn top_k_rows(probs: &[f64], width: usize, k: usize) -> Vec<usize> {
    use rayon::prelude::*;
    probs.par_chunks(width.max(1)).with_min_len(256).flat_map_iter(|row| top_k(row, k)).collect()
}

/// [`top_k_rows`] of the scores plus each expert's routing bias (`bias`, one per expert) when
/// there is one: the loss-free balancing's choice (the bias picks the experts, the weights stay
/// the router's, [`combine_weights`]). The one home of this rule: the single-process layer and
/// the distributed one both choose by it.
pub fn top_k_rows_biased(probs: &[f64], width: usize, k: usize, bias: Option<&[f64]>) -> Vec<usize> {
    match bias {
        Some(b) if b.len() == width && b.iter().any(|&x| x != 0.0) => {
            let biased: Vec<f64> = probs.chunks(width.max(1)).flat_map(|row| row.iter().zip(b).map(|(p, x)| p + x)).collect();
            top_k_rows(&biased, width, k)
        }
        _ => top_k_rows(probs, width, k),
    }
}

/// DeepSeek-V3's bias update after a step (Wang et al. 2024): each expert's bias moves by
/// `rate` toward the mean load, b_e += rate · sign(mean − load_e), from the step's loads over
/// the whole global batch (so every process that saw them moves the same bias the same way).
/// A step with no tokens leaves it as it is.
pub fn update_route_bias(bias: &mut [f64], load: &[u64], rate: f64) {
    let total: u64 = load.iter().sum();
    if total == 0 || bias.len() != load.len() {
        return;
    }
    let mean = total as f64 / load.len() as f64;
    for (b, &l) in bias.iter_mut().zip(load) {
        let l = l as f64;
        if l < mean {
            *b += rate;
        } else if l > mean {
            *b -= rate;
        }
    }
}

/// Trace-driven routing (as in the paper's experiments): assign `n` tokens k experts each so
/// that the number of assignments of each expert follows `loads` (apportioned by largest
/// remainder, at most `n` per expert so no token gets an expert twice). Returns n·k expert ids,
/// token-major.
pub fn assign_from_loads(loads: &[f64], n: usize, k: usize) -> Result<Vec<usize>> {
    let e = loads.len();
    if e < k {
        return Err(ModelError::config("routing trace", format!("{e} experts"), format!("fewer than top_k = {k}")));
    }
    if let Some((i, l)) = loads.iter().enumerate().find(|(_, l)| !l.is_finite() || **l < 0.0) {
        return Err(ModelError::config("routing trace", format!("{l} (expert {i})"), "loads must be finite and ≥ 0"));
    }
    let total: f64 = loads.iter().sum();
    let slots = n * k;
    let weights: Vec<f64> = if total > 0.0 { loads.to_vec() } else { vec![1.0; e] };
    let sum: f64 = weights.iter().sum();
    let mut count: Vec<usize> = weights.iter().map(|w| ((w / sum) * slots as f64).floor() as usize).collect();
    let mut order: Vec<usize> = (0..e).collect();
    order.sort_by(|&a, &b| {
        let ra = (weights[a] / sum) * slots as f64 - count[a] as f64;
        let rb = (weights[b] / sum) * slots as f64 - count[b] as f64;
        rb.total_cmp(&ra).then(a.cmp(&b))
    });
    let mut left = slots - count.iter().sum::<usize>();
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        count[i] += 1;
        left -= 1;
    }
    // Cap at n per expert; move the excess to experts with room, most loaded first.
    let mut excess: usize = count.iter().map(|&c| c.saturating_sub(n)).sum();
    count.iter_mut().for_each(|c| *c = (*c).min(n));
    for &i in &order {
        let room = n - count[i];
        let take = room.min(excess);
        count[i] += take;
        excess -= take;
    }
    // Slots sorted by expert; token t takes slots t, t+n, …: distinct experts since each expert
    // has at most n consecutive slots.
    let list: Vec<usize> = (0..e).flat_map(|i| std::iter::repeat_n(i, count[i])).collect();
    Ok((0..n).flat_map(|t| (0..k).map(move |j| t + j * n)).map(|s| list[s]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rows_top_k_over_the_cores_is_each_rows_in_row_order() {
        let width = 8;
        let mut r = crate::rng::SplitMix64::new(3);
        let probs: Vec<f64> = (0..5000 * width).map(|i| if i % 7 == 0 { 0.5 } else { r.uniform() }).collect(); // ties too
        let serial: Vec<usize> = probs.chunks(width).flat_map(|row| top_k(row, 2)).collect();
        assert_eq!(top_k_rows(&probs, width, 2), serial);
        assert!(top_k_rows(&[], width, 2).is_empty());
    }

    #[test]
    fn top_k_picks_distinct_largest() {
        assert_eq!(top_k(&[0.1, 0.5, 0.2, 0.5], 2), vec![1, 3]);
        assert_eq!(top_k(&[0.9, 0.05, 0.05], 1), vec![0]);
    }

    #[test]
    fn forced_assignment_follows_loads_with_distinct_experts() {
        let a = assign_from_loads(&[1.0, 1.0, 2.0, 4.0], 16, 2).unwrap();
        assert_eq!(a.len(), 32);
        let mut count = [0; 4];
        a.iter().for_each(|&e| count[e] += 1);
        assert_eq!(count, [4, 4, 8, 16]);
        for t in 0..16 {
            assert_ne!(a[2 * t], a[2 * t + 1]);
        }
        // An expert wanting more than one slot per token is capped at n.
        let a = assign_from_loads(&[0.0, 0.0, 100.0], 10, 2).unwrap();
        for t in 0..10 {
            assert_ne!(a[2 * t], a[2 * t + 1]);
        }
        assert!(assign_from_loads(&[1.0, f64::NAN], 4, 1).is_err());
        assert!(assign_from_loads(&[1.0], 4, 2).is_err());
    }
}

#[cfg(test)]
mod bias_tests {
    use super::*;

    #[test]
    fn the_bias_moves_toward_the_mean_and_only_picks() {
        let mut bias = vec![0.0; 4];
        // Mean 3: expert 0 over, 1 and 2 under, 3 at the mean.
        update_route_bias(&mut bias, &[6, 2, 1, 3], 0.5);
        assert_eq!(bias, vec![-0.5, 0.5, 0.5, 0.0]);
        update_route_bias(&mut bias, &[0, 0, 0, 0], 0.5);
        assert_eq!(bias, vec![-0.5, 0.5, 0.5, 0.0], "a step without tokens changes nothing");
        // Two tokens over four experts: the bias turns token 0's choice from expert 0 to 1, token
        // 1's from 3 to 2.
        let probs = [0.4, 0.3, 0.2, 0.1, 0.1, 0.2, 0.3, 0.4];
        assert_eq!(top_k_rows_biased(&probs, 4, 1, None), vec![0, 3]);
        assert_eq!(top_k_rows_biased(&probs, 4, 1, Some(&bias)), vec![1, 2]);
        assert_eq!(top_k_rows_biased(&probs, 4, 2, Some(&[0.0; 4])), top_k_rows(&probs, 4, 2));
    }
}
