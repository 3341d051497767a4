//! The closed label sets of ctxproxy's metrics, as enums: a call site names a variant, never a
//! string, and `ALL` creates every series at zero. Open sets (model, tenant, upstream) are
//! bounded by the config instead (see `ModelLabels`).

/// An enum of label values with `as_str()` and `ALL`.
macro_rules! label_set {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $value:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $value),+
                }
            }
        }
    };
}

label_set! {
    /// `route` of `ctxproxy_requests_total` and `ctxproxy_request_duration_seconds`.
    Route {
        ChatCompletions => "chat_completions",
        Responses => "responses",
        Explain => "explain",
        Passthrough => "passthrough",
        Healthz => "healthz",
        Readyz => "readyz",
        Metrics => "metrics",
        NotFound => "not_found",
    }
}

label_set! {
    /// Why an upstream call failed without an HTTP response.
    UpstreamError {
        Connect => "connect",
        /// The request failed after the connection was made.
        Request => "request",
        Timeout => "timeout",
        /// The response body failed midway.
        Body => "body",
        /// A stream event over `[upstream] max_event_bytes`: the stream was cut.
        EventTooLarge => "event_too_large",
    }
}

label_set! {
    /// Prompt tokens as the client sent them, and as they went upstream; of those that went
    /// upstream, the prompts of re-asks (an answer called a stub) are counted apart.
    TokenPhase {
        Original => "original",
        Sent => "sent",
        Reasked => "reasked",
    }
}

label_set! {
    /// Tool definitions as the client offered them, and as they went upstream: in full, or as
    /// stubs; of the stubs, those defined in the messages.
    ToolPhase {
        Offered => "offered",
        Sent => "sent",
        Stub => "stub",
        Defined => "defined",
    }
}

label_set! {
    /// What the token budget did with a request.
    BudgetOutcome {
        Fit => "fit",
        /// The floor alone is over the budget: sent, and flagged.
        OverFloor => "over_floor",
        Rejected => "rejected",
    }
}

label_set! {
    /// How the compact stage reduced a tool result.
    Compaction {
        Cleared => "cleared",
        Json => "json",
        Text => "text",
    }
}

label_set! {
    /// Which cache a lookup asked.
    CacheName {
        Deterministic => "deterministic",
        Dedup => "dedup",
    }
}

label_set! {
    /// What one cache lookup found.
    LookupResult {
        Hit => "hit",
        Miss => "miss",
        /// The request may not be answered from the cache.
        Bypass => "bypass",
        Error => "error",
    }
}

label_set! {
    /// Where a chat answer came from (also the `X-Ctxproxy-Cache` header).
    CacheOutcome {
        Hit => "hit",
        Dedup => "dedup",
        Miss => "miss",
        Bypass => "bypass",
        /// No cache was consulted (an error before the lookup, or caches off).
        None => "none",
    }
}

label_set! {
    /// Tokens of an upstream's `usage`.
    UsageKind {
        Prompt => "prompt",
        Completion => "completion",
        CachedPrompt => "cached_prompt",
        /// Of the completion, the reasoning tokens (`completion_tokens_details` on chat,
        /// `output_tokens_details` on the Responses API).
        Reasoning => "reasoning",
    }
}

label_set! {
    /// What a dollar saving came from.
    SavingSource {
        Pipeline => "pipeline",
        Cache => "cache",
    }
}

label_set! {
    /// Why a sampled exchange was not recorded.
    RecordDrop {
        QueueFull => "queue_full",
        /// An exchange larger than `[record] queue_max_bytes` on its own.
        TooLarge => "too_large",
        WriteError => "write_error",
        WriterStopped => "writer_stopped",
    }
}

label_set! {
    /// How a continued answer ended.
    ContinuationOutcome {
        Completed => "completed",
        MaxAttempts => "max_attempts",
        /// The next continuation would exceed the token budget.
        Budget => "budget",
        /// A continuation call failed: the cut answer was returned.
        Error => "error",
    }
}

label_set! {
    /// How an answer that called stubs (or called a tool defined only in the messages with
    /// arguments that fail its schema) was asked again.
    ExpansionOutcome {
        /// The called tools in full were enough.
        Expanded => "expanded",
        /// The last round allowed sent every tool in full.
        AllFull => "all_full",
        /// A call of a tool defined only in the messages failed the client's schema (the
        /// template dropped the definition): asked again with the tool in full in the block.
        InvalidArguments => "invalid_arguments",
        /// A re-ask failed: the client got the upstream's error.
        Error => "error",
    }
}

label_set! {
    /// What a call of `ctxproxy_recall` got.
    RecallOutcome {
        /// The original of the handle it named.
        Found => "found",
        /// A tool result saying the handle names nothing in this conversation.
        Unknown => "unknown",
    }
}

label_set! {
    /// What a request chained on a stored Response (`previous_response_id`) got of its chain's
    /// tool block, or what a stored Response's request left its chain.
    ChainToolsOutcome {
        /// The block its chain's previous request sent, sent again.
        Applied => "applied",
        /// No block is remembered for the Response it chains on: its tools went whole.
        Missing => "missing",
        /// A block is remembered, but the request sends its tools whole (other tools, a
        /// demanded call, or its answer cannot be expanded unseen).
        Whole => "whole",
        /// A stored Response's request sent a block of its own: remembered under its id.
        Remembered => "remembered",
    }
}

label_set! {
    /// What became of an answer that claims an action without a tool call.
    ClaimRepair {
        Off => "off",
        Repaired => "repaired",
        Failed => "failed",
    }
}

label_set! {
    /// A store operation.
    StoreOp {
        Get => "get",
        Set => "set",
        Delete => "delete",
        Push => "push",
        List => "list",
        Ping => "ping",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_the_documented_snake_case_names() {
        let values: Vec<&str> = UpstreamError::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(
            values,
            ["connect", "request", "timeout", "body", "event_too_large"]
        );
        for value in CacheOutcome::ALL.iter().map(|o| o.as_str()) {
            assert!(value.chars().all(|c| c.is_ascii_lowercase() || c == '_'));
        }
    }
}

label_set! {
    /// `cache` of `ctxproxy_memory_cache_bytes`: every cache the process holds in memory.
    MemoryCache {
        /// The pipeline's derived values (summaries, ledger lines, identifiers, catalogs).
        Memo => "memo",
        /// Whole rewrites that conversations append to.
        Rewrites => "rewrites",
        /// Token counts of messages and long texts.
        TokenCounts => "token_counts",
        /// Token counts of words, and of the texts and messages counted last (a fixed 64 KiB
        /// table), per worker thread.
        TokenPieces => "token_pieces",
        /// The in-memory store (the embedded default, or Redis's fallback).
        Store => "store",
    }
}
