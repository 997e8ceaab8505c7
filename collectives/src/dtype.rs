//! Element types and reduction kernels.
//!
//! Every type a collective moves implements [`Element`]: it names its [`DType`] on the wire and
//! knows how to combine two buffers under a [`ReduceOp`]. Half-precision types reduce in `f32` and
//! round once per step, so a sum of f16 gradients loses no more than one rounding per ring hop.

use std::fmt;

use half::{bf16, f16};

/// The element type of a buffer, as carried in every collective's descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// Unsigned 8-bit integer.
    U8 = 1,
    /// Signed 32-bit integer.
    I32 = 2,
    /// Signed 64-bit integer.
    I64 = 3,
    /// IEEE 754 half precision.
    F16 = 4,
    /// bfloat16.
    BF16 = 5,
    /// IEEE 754 single precision.
    F32 = 6,
    /// IEEE 754 double precision.
    F64 = 7,
}

impl DType {
    /// Decodes a wire tag; `None` for a tag no version of hvd writes.
    pub fn from_tag(tag: u8) -> Option<Self> {
        Some(match tag {
            1 => Self::U8,
            2 => Self::I32,
            3 => Self::I64,
            4 => Self::F16,
            5 => Self::BF16,
            6 => Self::F32,
            7 => Self::F64,
            _ => return None,
        })
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::F16 | Self::BF16 => 2,
            Self::I32 | Self::F32 => 4,
            Self::I64 | Self::F64 => 8,
        }
    }

    /// The lower-case name users write (`f32`, `bf16`, …).
    pub fn name(self) -> &'static str {
        match self {
            Self::U8 => "u8",
            Self::I32 => "i32",
            Self::I64 => "i64",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
            Self::F32 => "f32",
            Self::F64 => "f64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How allreduce and reducescatter combine the ranks' buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum = 1,
    /// Sum divided by the number of ranks (integer types truncate toward zero).
    Average = 2,
    /// Element-wise minimum.
    Min = 3,
    /// Element-wise maximum.
    Max = 4,
    /// Element-wise product.
    Product = 5,
    /// Adaptive summation (Maleki et al., "Scaling Distributed Training with Adaptive
    /// Summation"): pairs of ranks combine as `(1 − a·b/2‖a‖²)·a + (1 − a·b/2‖b‖²)·b`, per
    /// tensor, up a tree over the ranks. Floating-point types only (the `adasum` module).
    Adasum = 6,
}

impl ReduceOp {
    /// Decodes a wire tag.
    pub fn from_tag(tag: u8) -> Option<Self> {
        Some(match tag {
            1 => Self::Sum,
            2 => Self::Average,
            3 => Self::Min,
            4 => Self::Max,
            5 => Self::Product,
            6 => Self::Adasum,
            _ => return None,
        })
    }

    /// The op that is applied pairwise while reducing; Average sums and divides at the end.
    pub(crate) fn combining(self) -> Self {
        match self {
            Self::Average => Self::Sum,
            other => other,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Sum => "sum",
            Self::Average => "average",
            Self::Min => "min",
            Self::Max => "max",
            Self::Product => "product",
            Self::Adasum => "adasum",
        })
    }
}

/// A type that collectives can move and reduce.
///
/// `bytemuck::Pod` lets buffers go to and from sockets without a copy or `unsafe`.
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The wire tag of this type.
    const DTYPE: DType;

    /// Whether this is a floating-point type (the types Adasum combines).
    const FLOAT: bool;

    /// `acc[i] = acc[i] op src[i]` for every `i`; `op` is never [`ReduceOp::Average`] or
    /// [`ReduceOp::Adasum`], which is no element-wise combination (the communicator routes it
    /// to its own algorithm before any kernel runs).
    fn reduce_into(acc: &mut [Self], src: &[Self], op: ReduceOp);

    /// Divides every element by `n` (the last step of an average).
    fn divide(buf: &mut [Self], n: usize);

    /// The value as an `f64` (Adasum's dot products accumulate in double precision).
    fn to_f64(self) -> f64;

    /// The nearest value of this type to `v`.
    fn from_f64(v: f64) -> Self;
}

macro_rules! int_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            const FLOAT: bool = false;

            fn reduce_into(acc: &mut [Self], src: &[Self], op: ReduceOp) {
                let pairs = acc.iter_mut().zip(src);
                match op {
                    ReduceOp::Sum | ReduceOp::Average | ReduceOp::Adasum => {
                        pairs.for_each(|(a, b)| *a = a.wrapping_add(*b))
                    }
                    ReduceOp::Min => pairs.for_each(|(a, b)| *a = (*a).min(*b)),
                    ReduceOp::Max => pairs.for_each(|(a, b)| *a = (*a).max(*b)),
                    ReduceOp::Product => pairs.for_each(|(a, b)| *a = a.wrapping_mul(*b)),
                }
            }

            fn divide(buf: &mut [Self], n: usize) {
                // A world never has more ranks than any integer type here can count past
                // saturation; saturating keeps a u8 average of a huge world well defined.
                let n = <$t>::try_from(n).unwrap_or(<$t>::MAX);
                buf.iter_mut().for_each(|v| *v /= n);
            }

            fn to_f64(self) -> f64 {
                self as f64
            }

            fn from_f64(v: f64) -> Self {
                v as $t
            }
        }
    };
}

int_element!(u8, DType::U8);
int_element!(i32, DType::I32);
int_element!(i64, DType::I64);

macro_rules! float_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            const FLOAT: bool = true;

            fn reduce_into(acc: &mut [Self], src: &[Self], op: ReduceOp) {
                let pairs = acc.iter_mut().zip(src);
                match op {
                    ReduceOp::Sum | ReduceOp::Average | ReduceOp::Adasum => {
                        pairs.for_each(|(a, b)| *a += *b)
                    }
                    ReduceOp::Min => pairs.for_each(|(a, b)| *a = a.min(*b)),
                    ReduceOp::Max => pairs.for_each(|(a, b)| *a = a.max(*b)),
                    ReduceOp::Product => pairs.for_each(|(a, b)| *a *= *b),
                }
            }

            fn divide(buf: &mut [Self], n: usize) {
                let n = n as $t;
                buf.iter_mut().for_each(|v| *v /= n);
            }

            fn to_f64(self) -> f64 {
                self as f64
            }

            fn from_f64(v: f64) -> Self {
                v as $t
            }
        }
    };
}

float_element!(f32, DType::F32);
float_element!(f64, DType::F64);

macro_rules! half_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            const FLOAT: bool = true;

            fn reduce_into(acc: &mut [Self], src: &[Self], op: ReduceOp) {
                let f: fn(f32, f32) -> f32 = match op {
                    ReduceOp::Sum | ReduceOp::Average | ReduceOp::Adasum => |a, b| a + b,
                    ReduceOp::Min => f32::min,
                    ReduceOp::Max => f32::max,
                    ReduceOp::Product => |a, b| a * b,
                };
                for (a, b) in acc.iter_mut().zip(src) {
                    *a = <$t>::from_f32(f(a.to_f32(), b.to_f32()));
                }
            }

            fn divide(buf: &mut [Self], n: usize) {
                let n = n as f32;
                buf.iter_mut()
                    .for_each(|v| *v = <$t>::from_f32(v.to_f32() / n));
            }

            fn to_f64(self) -> f64 {
                self.to_f64()
            }

            fn from_f64(v: f64) -> Self {
                <$t>::from_f64(v)
            }
        }
    };
}

half_element!(f16, DType::F16);
half_element!(bf16, DType::BF16);

/// Calls the generic `$f::<T>(args)` for the element type `T` of a runtime [`DType`].
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            $crate::DType::U8 => $f::<u8>($($arg),*),
            $crate::DType::I32 => $f::<i32>($($arg),*),
            $crate::DType::I64 => $f::<i64>($($arg),*),
            $crate::DType::F16 => $f::<$crate::f16>($($arg),*),
            $crate::DType::BF16 => $f::<$crate::bf16>($($arg),*),
            $crate::DType::F32 => $f::<f32>($($arg),*),
            $crate::DType::F64 => $f::<f64>($($arg),*),
        }
    };
}
pub(crate) use by_dtype;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip() {
        for d in [
            DType::U8,
            DType::I32,
            DType::I64,
            DType::F16,
            DType::BF16,
            DType::F32,
            DType::F64,
        ] {
            assert_eq!(DType::from_tag(d as u8), Some(d));
        }
        assert_eq!(DType::from_tag(0), None);
        for op in [
            ReduceOp::Sum,
            ReduceOp::Average,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Product,
            ReduceOp::Adasum,
        ] {
            assert_eq!(ReduceOp::from_tag(op as u8), Some(op));
        }
    }

    #[test]
    fn half_reduces_in_f32() {
        let mut a = [f16::from_f32(1.5), f16::from_f32(-2.0)];
        f16::reduce_into(
            &mut a,
            &[f16::from_f32(2.5), f16::from_f32(3.0)],
            ReduceOp::Product,
        );
        assert_eq!(a, [f16::from_f32(3.75), f16::from_f32(-6.0)]);
        let mut b = [bf16::from_f32(4.0)];
        bf16::divide(&mut b, 4);
        assert_eq!(b, [bf16::from_f32(1.0)]);
    }

    #[test]
    fn integers_wrap_instead_of_panicking() {
        let mut a = [u8::MAX];
        u8::reduce_into(&mut a, &[2], ReduceOp::Sum);
        assert_eq!(a, [1]);
        let mut m = [5i64, -3];
        i64::reduce_into(&mut m, &[2, 7], ReduceOp::Min);
        assert_eq!(m, [2, -3]);
    }
}
