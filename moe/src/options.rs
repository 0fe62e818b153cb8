//! The settings a job gives a mixture-of-experts layer, as one value: the
//! `[model.moe]` table of `weft train` (behind the `serde` feature), turned
//! into a block's [`MoeConfig`] and checked by the block's own rules.

use crate::balance::{AuxLoss, AuxScope, BiasBalancer};
use crate::block::{Expert, MoeConfig};
use crate::error::{Error, Result};
use crate::router::{DropPolicy, Gate, Router};

/// How expert load is balanced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum Balance {
    /// No balancing.
    None,
    /// The Switch/GShard auxiliary loss ([`AuxLoss`]).
    Aux,
    /// DeepSeek-V3's auxiliary-loss-free selection bias
    /// ([`BiasBalancer`], applied after each optimizer step).
    #[default]
    Bias,
}

/// A job's mixture-of-experts settings (`experts = 0`: a dense model).
///
/// ```
/// use weft_moe::{Balance, MoeOptions};
///
/// let opts = MoeOptions { experts: 8, top_k: 2, balance: Balance::Aux, ..MoeOptions::default() };
/// let cfg = opts.config(64, 256).unwrap().unwrap();
/// assert_eq!(cfg.router.experts, 8);
/// assert!(cfg.aux.is_some());
/// assert!(MoeOptions::default().config(64, 256).unwrap().is_none()); // dense
/// ```
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields, default)
)]
pub struct MoeOptions {
    /// Experts per layer, E (0: a dense MLP).
    pub experts: usize,
    /// Experts per token, k.
    pub top_k: usize,
    /// How router scores become weights.
    pub gate: Gate,
    /// Normalise the gate weights over the chosen k.
    pub normalize: bool,
    /// How load is balanced.
    pub balance: Balance,
    /// Coefficient of the auxiliary loss (`balance = Aux`).
    pub aux_coef: f64,
    /// Update rate of the selection bias (`balance = Bias`). The default,
    /// 0.01, suits runs of hundreds to thousands of steps: at
    /// DeepSeek-V3's 0.001 (set for a run of trillions of tokens) a
    /// 200-step run on weft's default corpus still ends at MaxVio 2.06 —
    /// no better than no balancing — against 0.28 at 0.01.
    pub bias_rate: f64,
    /// Hidden width of each routed expert (0: the model's dense
    /// feed-forward width, GPT-2's 4·C or the gated MLP's
    /// `ffn_hidden`). Fine-grained experts are narrower than the dense
    /// MLP (Qwen3-MoE's and DeepSeek-V3's `moe_intermediate_size`).
    pub expert_hidden: usize,
    /// Shared experts that see every token, as one MLP of hidden width
    /// `shared_experts · expert width` (DeepSeek-V3's
    /// `n_shared_experts`; 0: none). The older spelling
    /// `shared_expert = true` is one shared expert.
    #[cfg_attr(
        feature = "serde",
        serde(alias = "shared_expert", deserialize_with = "count_or_flag")
    )]
    pub shared_experts: usize,
    /// A factor on every gate weight (DeepSeek-V3's
    /// `routed_scaling_factor`, 2.5 there; 1: none).
    pub routed_scale: f64,
    /// Capacity factor (0: dropless, the default and the causal choice).
    pub capacity_factor: f64,
    /// With a capacity: which assignments an expert over it drops.
    pub drop: DropPolicy,
}

impl Default for MoeOptions {
    fn default() -> Self {
        Self {
            experts: 0,
            top_k: 2,
            gate: Gate::Softmax,
            normalize: true,
            balance: Balance::Bias,
            aux_coef: 0.01,
            bias_rate: 1e-2,
            expert_hidden: 0,
            shared_experts: 0,
            routed_scale: 1.0,
            capacity_factor: 0.0,
            drop: DropPolicy::ByPosition,
        }
    }
}

impl MoeOptions {
    /// The block of a layer with `channels` channels whose dense
    /// feed-forward block is `hidden` wide (the experts' width unless
    /// [`expert_hidden`](Self::expert_hidden) is set), with GPT-2 MLP
    /// experts ([`Expert::Gelu`]; a model of the Llama family sets
    /// [`MoeConfig::expert`] to [`Expert::SwiGlu`]), or `None` for a dense
    /// model (`experts = 0`).
    ///
    /// # Errors
    /// [`Error::Config`] naming the field the block refuses
    /// ([`MoeConfig::validate`]: `top_k`, `capacity_factor`, ...).
    pub fn config(&self, channels: usize, hidden: usize) -> Result<Option<MoeConfig>> {
        if self.experts == 0 {
            return Ok(None);
        }
        let mut router = Router::top_k(self.experts, self.top_k)
            .with_gate(self.gate)
            .with_normalize(self.normalize)
            .with_scale(self.routed_scale);
        if self.capacity_factor != 0.0 {
            router = router.with_capacity(self.capacity_factor, self.drop);
        }
        let cfg = MoeConfig {
            channels,
            hidden: if self.expert_hidden > 0 {
                self.expert_hidden
            } else {
                hidden
            },
            router,
            expert: Expert::Gelu,
            shared_experts: self.shared_experts,
            aux: (self.balance == Balance::Aux).then_some(AuxLoss {
                coef: self.aux_coef,
                scope: AuxScope::Batch,
            }),
        };
        cfg.validate()?;
        Ok(Some(cfg))
    }

    /// The selection-bias balancer to apply after each step, with
    /// `balance = Bias`.
    #[must_use]
    pub fn bias_balancer(&self) -> Option<BiasBalancer> {
        (self.experts > 0 && self.balance == Balance::Bias)
            .then(|| BiasBalancer::new(self.bias_rate))
    }

    /// Experts a token is computed by: its `top_k` routed ones and the
    /// shared ones (0 for a dense model).
    #[must_use]
    pub fn active_experts(&self) -> usize {
        if self.experts == 0 {
            0
        } else {
            self.top_k + self.shared_experts
        }
    }

    /// Checks the settings without building a block (any channel count).
    ///
    /// # Errors
    /// As [`config`](Self::config); [`Error::Config`] for a negative or
    /// non-finite coefficient or rate.
    pub fn validate(&self) -> Result<()> {
        if self.experts == 0 {
            return Ok(());
        }
        for (field, v) in [("aux_coef", self.aux_coef), ("bias_rate", self.bias_rate)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::Config {
                    field,
                    reason: format!("is {v}; must be a finite number >= 0"),
                });
            }
        }
        self.config(1, 1).map(|_| ())
    }
}

/// `shared_experts` as a count, or in its older spelling a flag
/// (`shared_expert = true`: one).
#[cfg(feature = "serde")]
fn count_or_flag<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<usize, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum CountOrFlag {
        Count(usize),
        Flag(bool),
    }
    match <CountOrFlag as serde::Deserialize>::deserialize(d) {
        Ok(CountOrFlag::Count(n)) => Ok(n),
        Ok(CountOrFlag::Flag(b)) => Ok(usize::from(b)),
        Err(_) => Err(serde::de::Error::custom(
            "expected a count of shared experts (or, as `shared_expert`, true or false)",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_has_no_block_and_the_block_checks_its_fields() {
        assert_eq!(MoeOptions::default().config(8, 32).unwrap(), None);
        let bad = |o: MoeOptions| match o.validate() {
            Err(Error::Config { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let moe = MoeOptions {
            experts: 4,
            ..MoeOptions::default()
        };
        moe.validate().unwrap();
        assert_eq!(
            bad(MoeOptions {
                top_k: 5,
                ..moe.clone()
            }),
            "top_k"
        );
        assert_eq!(
            bad(MoeOptions {
                top_k: 0,
                ..moe.clone()
            }),
            "top_k"
        );
        assert_eq!(
            bad(MoeOptions {
                capacity_factor: -1.0,
                ..moe.clone()
            }),
            "capacity_factor"
        );
        assert_eq!(
            bad(MoeOptions {
                bias_rate: f64::NAN,
                ..moe.clone()
            }),
            "bias_rate"
        );
        let c = MoeOptions {
            capacity_factor: 1.25,
            drop: DropPolicy::ByScore,
            ..moe.clone()
        }
        .config(8, 32)
        .unwrap()
        .unwrap();
        assert!(!c.router.is_causal());
        assert_eq!(moe.active_experts(), 2);
        assert!(moe.bias_balancer().is_some());
    }
}
