//! The backward pass of our vendored candle-core (`vendor/README.md`): a tensor's first gradient
//! is kept as it is when it is already contiguous and of the tensor's shape, dtype and device,
//! instead of being added to zeroes. These graphs reach each branch of that rule — a gradient
//! shared by both arguments of an add, a gradient kept and then added to, a transposed (strided)
//! gradient, views into a larger gradient at an offset, a dtype change, a broadcast — and check
//! every gradient against its closed form.

use candle_core::{DType, Device, Tensor, Var};

fn var(values: &[f32], shape: (usize, usize)) -> Var {
    Var::from_tensor(&Tensor::from_slice(values, shape, &Device::Cpu).unwrap()).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn the_same_tensor_on_both_sides_of_an_add_gets_both_gradients() {
    let x = var(&[1.0, -2.0, 3.0, 0.5], (2, 2));
    let y = (x.as_tensor() + x.as_tensor()).unwrap().sum_all().unwrap();
    let grads = y.backward().unwrap();
    assert_eq!(values(grads.get(&x).unwrap()), vec![2.0; 4]);
}

#[test]
fn a_gradient_kept_as_it_is_and_then_added_to_is_not_changed_under_another_tensor() {
    // y = Σ (x ⊙ w + x): x gets the add's gradient as it is (shared with the product's), then
    // the product's gradient is added to it: dx = w + 1, and the product node's own gradient
    // (ones) must not have changed.
    let x = var(&[1.0, 2.0, 3.0, 4.0], (2, 2));
    let w = var(&[0.5, -1.0, 2.0, 0.0], (2, 2));
    let prod = (x.as_tensor() * w.as_tensor()).unwrap();
    let y = (&prod + x.as_tensor()).unwrap().sum_all().unwrap();
    let grads = y.backward().unwrap();
    assert_eq!(values(grads.get(&x).unwrap()), vec![1.5, 0.0, 3.0, 1.0]);
    assert_eq!(values(grads.get(&w).unwrap()), vec![1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn a_strided_gradient_is_stored_contiguous() {
    // y = Σ xᵀ ⊙ c: the gradient reaches x transposed (a strided view).
    let x = var(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], (2, 3));
    let c = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], (3, 2), &Device::Cpu).unwrap();
    let y = (x.as_tensor().t().unwrap() * &c).unwrap().sum_all().unwrap();
    let grads = y.backward().unwrap();
    let g = grads.get(&x).unwrap();
    assert!(g.is_contiguous());
    assert_eq!(g.dims(), &[2, 3]);
    assert_eq!(values(g), vec![1.0, 3.0, 5.0, 2.0, 4.0, 6.0]);
}

#[test]
fn gradients_that_are_views_at_an_offset_read_back_right() {
    // z = [a; b] (rows), y = Σ z ⊙ z: each part's gradient is a view into z's, b's at an offset.
    let a = var(&[1.0, 2.0], (1, 2));
    let b = var(&[3.0, -4.0, 5.0, 6.0], (2, 2));
    let z = Tensor::cat(&[a.as_tensor(), b.as_tensor()], 0).unwrap();
    let y = z.sqr().unwrap().sum_all().unwrap();
    let grads = y.backward().unwrap();
    assert_eq!(values(grads.get(&a).unwrap()), vec![2.0, 4.0]);
    let gb = grads.get(&b).unwrap();
    assert_eq!(gb.dims(), &[2, 2]);
    assert_eq!(values(gb), vec![6.0, -8.0, 10.0, 12.0]);
    assert_eq!(gb.to_vec2::<f32>().unwrap(), vec![vec![6.0, -8.0], vec![10.0, 12.0]]);
}

#[test]
fn a_dtype_change_and_a_broadcast_give_gradients_of_the_tensors_own_kind() {
    let x = var(&[1.0, 2.0, 3.0], (1, 3));
    let bias = Var::from_tensor(&Tensor::from_slice(&[0.5f32, 0.5, 0.5], 3, &Device::Cpu).unwrap()).unwrap();
    let wide = x.as_tensor().broadcast_as((2, 3)).unwrap().broadcast_add(bias.as_tensor()).unwrap();
    let y = (wide.to_dtype(DType::F64).unwrap() * 3.0).unwrap().sum_all().unwrap();
    let grads = y.backward().unwrap();
    let gx = grads.get(&x).unwrap();
    assert_eq!((gx.dtype(), gx.dims()), (DType::F32, &[1usize, 3][..]));
    assert_eq!(values(gx), vec![6.0; 3]);
    assert_eq!(values(grads.get(&bias).unwrap()), vec![6.0; 3]);
}

#[test]
fn a_large_gradient_from_a_matmul_is_summed_over_the_pool_without_keeping_its_graph() {
    // y = Σ x·W + Σ x ⊙ c with x of 300 × 256 (over the size added over the pool): x's first
    // gradient comes from the matmul (computed from the variable W, so it records its op), the
    // second is added to it: dx[i][j] = Σ_m W[j][m] + c[i][j], exact in small integers.
    let (n, k, m) = (300, 256, 4);
    let xs: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 - 3.0).collect();
    let ws: Vec<f32> = (0..k * m).map(|i| (i % 3) as f32).collect();
    let cs: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32).collect();
    let (x, w) = (var(&xs, (n, k)), var(&ws, (k, m)));
    let c = Tensor::from_slice(&cs, (n, k), &Device::Cpu).unwrap();
    let mm = x.as_tensor().matmul(w.as_tensor()).unwrap().sum_all().unwrap();
    let prod = (x.as_tensor() * &c).unwrap().sum_all().unwrap();
    let grads = (mm + prod).unwrap().backward().unwrap();
    let gx = grads.get(&x).unwrap();
    let want: Vec<f32> = (0..n * k).map(|i| (0..m).map(|q| ws[(i % k) * m + q]).sum::<f32>() + cs[i]).collect();
    assert_eq!(values(gx), want);
    if std::env::var("CANDLE_GRAD_DO_NOT_DETACH").map_or(true, |v| v.is_empty() || v == "0") {
        // The sum is detached when its node is reached anyway: it carries no graph.
        assert!(!gx.track_op());
    }
}
