//! Held-out evaluation over the ranks: the mean next-token loss over windows taken in order, as
//! [`lazarus_model::eval::evaluate`] takes it in one process, with every pass's windows shared
//! out over the ranks and each MoE layer dispatched across them as in training. Forward only:
//! nothing that outlives the call changes.

use candle_core::Tensor;
use lazarus_comm::{all_reduce_sum_f32, Group, Transport};
use lazarus_model::eval::{window_rows, windows_to_take, Evaluation};
use lazarus_model::model::cross_entropy;

use super::{batch_share, Worker};
use crate::error::RuntimeError;

impl Worker {
    /// The loss over the first `windows` windows of `tokens` (None: every whole one), in passes
    /// of `batch_size` windows. Every rank must call it together with the same arguments.
    ///
    /// A rank with no window in a pass (a last pass smaller than the world) still takes part in
    /// its MoE layers' collectives: it runs the pass's first window and counts it with weight 0.
    pub fn evaluate(
        &mut self,
        t: &mut dyn Transport,
        world: &mut Group,
        tokens: &[u32],
        windows: Option<usize>,
    ) -> Result<Evaluation, RuntimeError> {
        let cfg = &self.trainer.config;
        let (tl, batch, vocab) = (cfg.seq_len, cfg.batch_size.max(1), cfg.model.vocab_size);
        if let Some(&bad) = tokens.iter().find(|&&x| x as usize >= vocab) {
            return Err(RuntimeError::Invalid {
                field: "held-out tokens",
                reason: format!("token {bad} outside the vocabulary of {vocab}"),
            });
        }
        let n = windows_to_take(tokens.len(), tl, windows)?;
        // The model's own routing: no catch-up boost for restored experts while evaluating.
        let catching_up: Vec<Vec<usize>> = self.layers.iter_mut().map(|l| std::mem::take(&mut l.catching_up)).collect();
        let sum = self.local_loss_sum(t, world, tokens, n, batch);
        for (layer, c) in self.layers.iter_mut().zip(catching_up) {
            layer.catching_up = c;
        }
        let mut total = [sum? as f32];
        all_reduce_sum_f32(t, world, &mut total, self.timeout)?;
        Ok(Evaluation::of_sum(f64::from(total[0]), n, tl))
    }

    /// This rank's part of the sum of the per-window mean losses of the first `n` windows.
    fn local_loss_sum(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        tokens: &[u32],
        n: usize,
        batch: usize,
    ) -> Result<f64, RuntimeError> {
        let tl = self.trainer.config.seq_len;
        let device = self.trainer.model.device().clone();
        let mut sum = 0.0f64;
        for first in (0..n).step_by(batch) {
            let count = batch.min(n - first);
            let (lo, hi) = batch_share(count, self.world, self.rank);
            let (lo, rows, weight) = if hi > lo { (lo, hi - lo, 1.0) } else { (0, 1, 0.0) };
            let (x, y) = window_rows(tokens, tl, first + lo, rows);
            let inputs = Tensor::from_vec(x, (rows, tl), &device)?;
            let targets = Tensor::from_vec(y, rows * tl, &device)?;
            let mean = self.forward_loss(t, world, &inputs, &targets)?;
            sum += weight * mean * rows as f64;
        }
        Ok(sum)
    }

    /// The mean next-token loss of `inputs` [rows, T] against `targets` [rows·T] through every
    /// block, the MoE layers dispatched over the ranks.
    fn forward_loss(&self, t: &mut dyn Transport, world: &mut Group, inputs: &Tensor, targets: &Tensor) -> Result<f64, RuntimeError> {
        let model = &self.trainer.model;
        let (rows, tl) = inputs.dims2()?;
        let d = model.config().d_model;
        let mut x = model.embed(inputs)?;
        let mut moe_index = 0;
        for block in 0..model.config().n_layers {
            let (x_mid, h) = model.block_attention(block, &x)?;
            let (y, _) = self.block_ffn(t, world, block, &mut moe_index, &h)?;
            x = lazarus_model::ops::residual_add(&x_mid, &y.reshape((rows, tl, d))?)?.detach();
        }
        let logits = model.logits(&x)?;
        Ok(cross_entropy(&logits, targets)?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?)
    }
}
