//! The whole rewriting pipeline on synthetic agent conversations: the proxy overhead a chat
//! request pays (targets: 20 turns ~30 KB under 200 µs, 100 turns ~200 KB under 1 ms).
//!
//! Four cache states: `next_turn` is the steady state of a running proxy (the conversation's
//! previous request was rewritten, this one adds a turn); `repeat` is the same request again;
//! `cold` is a conversation the process never saw (fresh token-count cache and memo), decided
//! from its history alone; `cold_remembered` is the same with the state the store remembers
//! after the previous request (a replica that did not serve the conversation, with Redis).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};

// The allocator the binary runs with (src/main.rs): a rewrite allocates much, and the system's
// allocator would time another program.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use ctxproxy::openai::ChatRequest;
use ctxproxy::pipeline::{self, Memo, PipelineConfig};
use ctxproxy::synthetic;
use ctxproxy::tokens::{Encoding, TokenCounter};

fn rewrite(request: &ChatRequest, config: &PipelineConfig, caches: &(TokenCounter, Memo)) {
    std::hint::black_box(rewrite_from(request, config, caches, None));
}

fn rewrite_from(
    request: &ChatRequest,
    config: &PipelineConfig,
    caches: &(TokenCounter, Memo),
    remembered: Option<pipeline::PrefixState>,
) -> pipeline::Rewrite {
    pipeline::run(
        std::hint::black_box(request),
        &pipeline::Env {
            config,
            counter: &caches.0,
            memo: &caches.1,
            budget: config.budget.max_tokens,
            sticky_categories: &[],
            reinforcement: None,
            remembered,
        },
    )
}

fn fresh_caches() -> (TokenCounter, Memo) {
    (TokenCounter::new(Encoding::O200kBase), Memo::default())
}

fn whole_pipeline(c: &mut Criterion) {
    let config = PipelineConfig::default();
    let mut group = c.benchmark_group("pipeline");
    for turns in [20, 100] {
        let request = synthetic::conversation(turns).unwrap();
        let previous = synthetic::conversation(turns - 1).unwrap();
        let kb = serde_json::to_vec(&request).unwrap().len() / 1024;
        let name = format!("{turns}_turns_{kb}KB");
        group.bench_function(format!("next_turn_{name}"), |b| {
            b.iter_batched(
                || {
                    let caches = fresh_caches();
                    rewrite(&previous, &config, &caches);
                    caches
                },
                // The caches are returned, so dropping them is not timed.
                |caches| {
                    rewrite(&request, &config, &caches);
                    caches
                },
                BatchSize::PerIteration,
            )
        });
        let warm = fresh_caches();
        rewrite(&request, &config, &warm);
        group.bench_function(format!("repeat_{name}"), |b| {
            b.iter(|| rewrite(&request, &config, &warm))
        });
        // The agent's last request before this one (the tool result's), as the store holds it.
        let mut before = request.clone();
        before.messages.truncate(request.messages.len() - 2);
        let remembered = rewrite_from(&before, &config, &fresh_caches(), None).remember;
        group.bench_function(format!("cold_remembered_{name}"), |b| {
            b.iter_batched(
                fresh_caches,
                |caches| {
                    std::hint::black_box(rewrite_from(&request, &config, &caches, remembered));
                    caches
                },
                BatchSize::PerIteration,
            )
        });
        group.bench_function(format!("cold_{name}"), |b| {
            b.iter_batched(
                fresh_caches,
                |caches| {
                    rewrite(&request, &config, &caches);
                    caches
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, whole_pipeline);
criterion_main!(benches);
