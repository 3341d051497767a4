//! The input bill with the provider's prompt cache: which tokens of a prompt are billed at the
//! cached price (OpenAI's rule), and what a rewrite saved a request once that is counted. Pure;
//! `ctxproxy analyze --cost` and the proxy's `ctxproxy_cost_saved_usd_total` both use it.

use crate::config::ModelPrice;

/// OpenAI's rule: no caching under this many tokens, then in steps of `CACHE_STEP`.
const MIN_CACHED: usize = 1024;
const CACHE_STEP: usize = 128;

/// Cached tokens for a common prefix of `prefix` tokens with the previous prompt.
pub fn cached_of(prefix: usize) -> usize {
    if prefix < MIN_CACHED {
        0
    } else {
        prefix / CACHE_STEP * CACHE_STEP
    }
}

/// A prompt's input tokens, and how many of them were (or would have been) billed as cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prompt {
    pub tokens: usize,
    pub cached: usize,
}

impl Prompt {
    /// What the prompt costs, in US dollars.
    pub fn usd(self, price: &ModelPrice) -> f64 {
        let cached = self.cached.min(self.tokens) as f64;
        ((self.tokens as f64 - cached) * price.input + cached * price.cached_input()) / 1e6
    }
}

/// What sending `sent` instead of `original` saved, in US dollars; negative when the rewrite
/// cost more (it broke a cached prefix the original would have reused).
pub fn saved_usd(original: Prompt, sent: Prompt, price: &ModelPrice) -> f64 {
    original.usd(price) - sent.usd(price)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPT_4O: ModelPrice = ModelPrice {
        input: 2.5,
        output: 10.0,
        cached_input: Some(1.25),
    };

    #[test]
    fn the_cache_counts_from_1024_tokens_in_steps_of_128() {
        assert_eq!(cached_of(1023), 0);
        assert_eq!(cached_of(1024), 1024);
        assert_eq!(cached_of(1300), 1280);
    }

    #[test]
    fn a_saving_counts_the_cached_price_and_may_be_negative() {
        let original = Prompt {
            tokens: 10_000,
            cached: 9_000,
        };
        // 2,000 fewer tokens, all of them from the cached part: 2,000 × 1.25 per million.
        let appended = Prompt {
            tokens: 8_000,
            cached: 7_000,
        };
        let saved = saved_usd(original, appended, &GPT_4O);
        assert!((saved - 2_000.0 * 1.25 / 1e6).abs() < 1e-12, "{saved}");
        // The same 8,000 tokens with the prefix broken cost more than the cached original.
        let broken = Prompt {
            tokens: 8_000,
            cached: 0,
        };
        assert!(saved_usd(original, broken, &GPT_4O) < 0.0);
        // Without a cached price, only the tokens count.
        let flat = ModelPrice {
            cached_input: None,
            ..GPT_4O
        };
        assert!((saved_usd(original, broken, &flat) - 2_000.0 * 2.5 / 1e6).abs() < 1e-12);
    }
}
