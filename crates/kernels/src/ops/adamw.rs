//! AdamW on every tensor of a model in one launch.

use crate::{adamw_list, adamw_table, AdamWTensor, Device};

/// AdamW's update of each tensor of the list in place (and its bf16 working copy, where it has
/// one), in one launch over a table of their addresses, lengths and coefficients: each element
/// gets [`crate::adamw`]'s bits. Nothing to do for an empty list.
///
/// # Safety
/// Each record's addresses hold `n` elements of their documented types on `dev`, and no two
/// records name the same parameter, moment or copy.
pub unsafe fn adamw_all<D: Device>(dev: &D, tensors: &[AdamWTensor]) -> Result<(), D::Error> {
    let table = adamw_table(tensors);
    let parts = table[tensors.len()] as usize;
    if tensors.is_empty() || parts == 0 {
        return Ok(());
    }
    let on_device = dev.upload_u64(&table)?;
    let l = adamw_list(dev.addr(&on_device), tensors.len(), parts)?;
    // SAFETY: the table is the tensors' (uploaded above); their buffers as the caller promises.
    unsafe { dev.launch(&l) }
}
