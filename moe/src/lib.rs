//! Mixture-of-experts routing that keeps causality.
//!
//! This crate will own routers (token-choice top-k, expert choice, capacity
//! with drop policies), load balancing (auxiliary loss and
//! auxiliary-loss-free bias balancing), an empirical causality audit for any
//! router, expert-parallel dispatch/combine over all-to-all, and expert-load
//! statistics.
//!
//! Nothing is implemented yet. See the moe issue for the plan.
