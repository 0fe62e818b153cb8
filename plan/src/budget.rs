//! Budgeting: a compute budget to the compute-optimal model size and
//! token count, and how long a layout takes.
//!
//! The scaling law is Hoffmann et al. 2022 ("Training Compute-Optimal
//! Large Language Models", the Chinchilla paper): with training compute
//! `C = 6·N·D` (Kaplan et al. 2020), the loss-optimal parameters `N` and
//! tokens `D` grow as `C^0.5` each (their approaches 1 and 2:
//! `a = 0.50, b = 0.50` and `a = 0.49, b = 0.51`), at about 20 tokens per
//! parameter (their Table 3: 70B parameters and 1.4T tokens for 5.76e23
//! FLOPs). So `N_opt = sqrt(C / 120)` and `D_opt = 20·N_opt`. The loss is
//! their approach 3 fit, `L(N, D) = 1.69 + 406.4/N^0.34 + 410.7/D^0.28`
//! (nats per token on their MassiveText data: a relative guide, not a
//! prediction for other data).

use serde::Serialize;

/// Tokens per parameter at the compute optimum (Hoffmann et al. 2022).
pub const TOKENS_PER_PARAM: f64 = 20.0;

/// The compute-optimal point of a budget.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Optimum {
    /// The budget, FLOPs.
    pub flops: f64,
    /// Parameters, `sqrt(C/120)`.
    pub params: f64,
    /// Tokens, `20 · params`.
    pub tokens: f64,
    /// Approach 3's loss at that point.
    pub loss: f64,
}

/// Hoffmann et al.'s approach 3 loss for `params` and `tokens`.
#[must_use]
pub fn chinchilla_loss(params: f64, tokens: f64) -> f64 {
    1.69 + 406.4 / params.powf(0.34) + 410.7 / tokens.powf(0.28)
}

/// The compute-optimal model size and token count for `flops`.
#[must_use]
pub fn optimum(flops: f64) -> Optimum {
    let params = (flops / (6.0 * TOKENS_PER_PARAM)).sqrt();
    let tokens = TOKENS_PER_PARAM * params;
    Optimum {
        flops,
        params,
        tokens,
        loss: chinchilla_loss(params, tokens),
    }
}

/// A budget against a model and the throughput of its chosen layout.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BudgetReport {
    /// The compute-optimal point of the budget.
    pub optimum: Optimum,
    /// The planned model's parameters.
    pub params: f64,
    /// Tokens the budget buys for the planned model (`C / (6·N)`).
    pub tokens: f64,
    /// Its compute-optimal token count (`20·N`).
    pub optimal_tokens: f64,
    /// Tokens per second of the chosen layout.
    pub tokens_per_s: f64,
    /// Days the chosen layout takes for `tokens`.
    pub days: f64,
    /// Days it takes for `optimal_tokens`.
    pub optimal_days: f64,
    /// GPU-hours of `days` on the cluster.
    pub gpu_hours: f64,
}

/// The budget of `flops` for a model of `params` parameters trained at
/// `tokens_per_s` on `gpus` GPUs.
#[must_use]
pub fn report(flops: f64, params: f64, tokens_per_s: f64, gpus: usize) -> BudgetReport {
    let tokens = flops / (6.0 * params);
    let optimal_tokens = TOKENS_PER_PARAM * params;
    let day = 86_400.0;
    let days = tokens / tokens_per_s / day;
    BudgetReport {
        optimum: optimum(flops),
        params,
        tokens,
        optimal_tokens,
        tokens_per_s,
        days,
        optimal_days: optimal_tokens / tokens_per_s / day,
        gpu_hours: days * 24.0 * gpus as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chinchilla_budget_gives_chinchilla() {
        // Chinchilla: 70B parameters, 1.4T tokens ≈ 5.88e23 FLOPs by 6ND
        let o = optimum(6.0 * 70e9 * 1.4e12);
        assert!((o.params - 70e9).abs() / 70e9 < 1e-9, "{}", o.params);
        assert!((o.tokens - 1.4e12).abs() / 1.4e12 < 1e-9);
        // approach 3 at that point: about 1.94 nats
        assert!((o.loss - 1.94).abs() < 0.02, "{}", o.loss);
    }

    #[test]
    fn budget_days_follow_throughput() {
        let r = report(6.0 * 1e9 * 1e11, 1e9, 1e6, 64);
        assert!((r.tokens - 1e11).abs() < 1.0);
        assert!((r.days - 1e5 / 86_400.0).abs() < 1e-9);
        assert!((r.gpu_hours - r.days * 24.0 * 64.0).abs() < 1e-9);
    }
}
