//! The project's seeded generator (SplitMix64), shared with the planning core.

pub use lazarus_plan::rng::SplitMix64;
