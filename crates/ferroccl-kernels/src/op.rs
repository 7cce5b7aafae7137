//! The reduction operations.

/// A reduction operation, applied element by element.
///
/// The exact semantics of each operation for each [`DType`](crate::DType) are defined by the
/// [`reference`](mod@crate::reference) module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (integers wrap).
    Sum,
    /// Product (integers wrap).
    Prod,
    /// Minimum (floats: NaN propagates, -0.0 < +0.0).
    Min,
    /// Maximum (floats: NaN propagates, -0.0 < +0.0).
    Max,
    /// Average: the sum divided by the number of contributions.
    Avg,
}

impl ReduceOp {
    /// Every operation.
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

    /// The name users write (`sum`, `prod`, `min`, `max`, `avg`).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// Parses a user-facing name (`sum`, `prod`, `min`, `max`, `avg`).
    pub fn parse(name: &str) -> Option<ReduceOp> {
        ReduceOp::ALL.iter().copied().find(|o| o.name() == name)
    }

    /// The operation a single pairwise step performs: [`ReduceOp::Avg`] steps are sums (the
    /// division happens once, at the end); every other operation is itself.
    pub const fn step(self) -> ReduceOp {
        match self {
            ReduceOp::Avg => ReduceOp::Sum,
            op => op,
        }
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
