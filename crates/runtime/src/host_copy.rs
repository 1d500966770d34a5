//! Tensors to one host buffer and back, for what must cross processes (the transport speaks
//! host bytes): on a GPU one device-to-host copy of one contiguous buffer instead of one per
//! tensor (each a synchronisation), and one host-to-device copy back with every tensor a view
//! into it; on the CPU each tensor is read in place and the way back is free (views again).

use candle_core::{DType, Device, Tensor};

use crate::error::RuntimeError;

/// The f32 elements of `parts` one after another (None: `lens[i]` zeros), in one host buffer.
pub fn to_host(parts: &[Option<Tensor>], lens: &[usize]) -> Result<Vec<f32>, RuntimeError> {
    let _p = lazarus_model::profile::kernel("to host");
    if parts.len() != lens.len() {
        return Err(RuntimeError::Invalid { field: "host buffer", reason: format!("{} tensors, {} lengths", parts.len(), lens.len()) });
    }
    if let Some((i, t)) = parts.iter().enumerate().find_map(|(i, p)| p.as_ref().filter(|t| t.elem_count() != lens[i]).map(|t| (i, t))) {
        return Err(RuntimeError::Invalid {
            field: "host buffer",
            reason: format!("tensor {i} has {} values, not {}", t.elem_count(), lens[i]),
        });
    }
    let total: usize = lens.iter().sum();
    if parts.iter().flatten().all(|t| t.device().is_cpu()) {
        let flat = lazarus_model::ops::with_f32_slices(parts, |slices| {
            let mut flat = Vec::with_capacity(total);
            for (s, &len) in slices.iter().zip(lens) {
                match s {
                    Some(s) => flat.extend_from_slice(s),
                    None => flat.resize(flat.len() + len, 0.0),
                }
            }
            flat
        })?;
        return Ok(flat);
    }
    let device = parts.iter().flatten().next().map(|t| t.device().clone()).unwrap_or(Device::Cpu);
    let mut list = Vec::with_capacity(parts.len());
    for (p, &len) in parts.iter().zip(lens) {
        list.push(match p {
            Some(t) => t.flatten_all()?.to_dtype(DType::F32)?,
            None => Tensor::zeros(len, DType::F32, &device)?,
        });
    }
    if list.is_empty() {
        return Ok(Vec::new());
    }
    Ok(Tensor::cat(&list, 0)?.to_vec1()?)
}

/// `flat` on `device` as one tensor, cut into consecutive views of `shapes` (no copy of each).
pub fn from_host(flat: Vec<f32>, shapes: &[&[usize]], device: &Device) -> Result<Vec<Tensor>, RuntimeError> {
    let _p = lazarus_model::profile::kernel("to device");
    let len = flat.len();
    let need: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    if need != len {
        return Err(RuntimeError::Invalid { field: "host buffer", reason: format!("{len} values for tensors of {need}") });
    }
    let all = Tensor::from_vec(flat, len, device)?;
    let mut at = 0;
    let mut out = Vec::with_capacity(shapes.len());
    for shape in shapes {
        let n: usize = shape.iter().product();
        out.push(all.narrow(0, at, n)?.reshape(*shape)?);
        at += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_go_to_one_buffer_and_come_back_as_views_of_their_shapes() {
        let a = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap();
        let b = Tensor::new(&[5f32, 6.0, 7.0], &Device::Cpu).unwrap();
        let flat = to_host(&[Some(a.clone()), None, Some(b.clone())], &[4, 2, 3]).unwrap();
        assert_eq!(flat, vec![1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 5.0, 6.0, 7.0]);
        let back = from_host(flat, &[&[2, 2], &[2], &[3]], &Device::Cpu).unwrap();
        assert_eq!(back[0].to_vec2::<f32>().unwrap(), a.to_vec2::<f32>().unwrap());
        assert_eq!(back[1].to_vec1::<f32>().unwrap(), vec![0.0, 0.0]);
        assert_eq!(back[2].to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
        // A transposed (non-contiguous) tensor is read in its logical order.
        let t = a.t().unwrap();
        assert_eq!(to_host(&[Some(t)], &[4]).unwrap(), vec![1.0, 3.0, 2.0, 4.0]);
        let e = from_host(vec![0.0; 5], &[&[2, 2]], &Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("5 values for tensors of 4"), "{e}");
        let e = to_host(&[Some(b)], &[4]).unwrap_err().to_string();
        assert!(e.contains("tensor 0 has 3 values, not 4"), "{e}");
    }
}
