//! Prefix stability (ARCHITECTURE.md, principle 4): within a conversation, a rewrite changes what was
//! already sent only when that pays for the provider's prompt cache it invalidates.
//!
//! Every earlier request of a conversation is a *point* of the history the client sends: the
//! messages before one of its assistant messages. The first point is rewritten whole and
//! becomes the conversation's anchor. At each later point, the whole rewrite is compared with
//! the anchor's rewrite followed by the messages sent since (appended: a tool result in its
//! working-set form, the rest as the client sent it). The whole rewrite becomes the new anchor
//! (a recompaction) when it is smaller by at least `clear_at_least_tokens`, when it sends other
//! tools or starts the reminder, or when appending would go over the budget that the whole
//! rewrite fits; otherwise the appended form is sent, so the prompt sent before is a prefix of
//! this one, byte for byte. Where the tools stage sends the client's tools as they are whatever
//! the messages say (a small block, filtering off, a demanded call), the recall tool alone is not
//! another block: it comes with what a rebuild clears, and appending clears nothing.
//!
//! The decisions are a function of the history and the request's settings, so any replica
//! reaches them; each point's decision is memoized, and a state remembered in the store is a
//! point to resume from. Nothing here does I/O.

use std::hash::{BuildHasher, Hash, Hasher};
use std::rc::Rc;
use std::sync::Arc;

use foldhash::quality::FixedState;
use serde::{Deserialize, Serialize};

use super::compact;
use super::recall;
use super::stage::StageName;
use super::tools::append::{
    definitions_from, previous_turn_categories, sends_block_whole, without_tools,
};
use super::working_set::WorkingSet;
use super::{Env, PipelineConfig, Rewrite, with_messages};
use crate::guards::ReinforcementConfig;
use crate::openai::{ChatRequest, Message, Nullable, Role, Tool};
use crate::tokens::{hash_message, hash_message_stored};

/// What the store remembers of a conversation: as of the request that sent its first `as_of`
/// messages (whose history and settings hash to `digest`), the rewrite was last rebuilt whole
/// at its first `anchor` messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixState {
    pub anchor: usize,
    pub as_of: usize,
    pub digest: u64,
}

/// Why a request's rewrite was rebuilt whole instead of appended to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rebuilt {
    /// The conversation's first request, as its history shows.
    First,
    /// Rewriting whole removes at least `clear_at_least_tokens` more than appending.
    Pays,
    /// The tools to send changed (the block grew).
    ToolsChanged,
    /// The reinforcement reminder starts.
    ReminderStarted,
    /// Appending would go over the budget, and the whole rewrite fits it.
    Budget,
    /// Nothing was memoized or remembered of a conversation with more than `MAX_REPLAY`
    /// earlier requests: rebuilt rather than replayed (a bound on a cold replica's work).
    LongHistory,
}

/// How a request's rewrite relates to the conversation's earlier ones.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrefixReport {
    /// The client's messages covered by the rewrite that later ones are appended to.
    pub anchor_messages: usize,
    /// Messages appended after it (0 when rebuilt).
    pub appended_messages: usize,
    /// Set when this request's rewrite was rebuilt whole.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rebuilt: Option<Rebuilt>,
    /// Tokens of the whole rewrite: what a recompaction would send now (`None` when it was
    /// not made: what no step cuts already left rebuilding unable to pay).
    pub whole_tokens: Option<usize>,
    /// Tokens of the client's previous request (the point before this one), as it sent them:
    /// the prefix a provider would have found cached without the rewrite.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous_tokens: Option<usize>,
}

/// `append`: messages appended to the conversation's previous rewrite, and how many of them
/// were compacted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AppendDetails {
    pub appended: usize,
    pub compacted: usize,
}

/// What the recall pairs put back read of it (`recall::replay`).
impl From<&PrefixReport> for recall::Appended {
    fn from(report: &PrefixReport) -> recall::Appended {
        recall::Appended {
            anchor_messages: report.anchor_messages,
            appended_messages: report.appended_messages,
        }
    }
}

/// One request of the conversation: its first `len` messages, and the hash of those and of
/// the request's settings.
#[derive(Debug, Clone, Copy)]
struct Point {
    len: usize,
    digest: u64,
}

/// What the decisions read of a whole rewrite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Whole {
    tokens: usize,
    names: Names,
    /// The digest of the tools it sends, definitions and all (`block_digest`).
    block: u64,
    reminder: bool,
    fits: bool,
}

/// The digests of the names of the tools a rewrite sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Names {
    /// The names, in order: the same names with other definitions are a tool promoted in place
    /// (a strict tool the conversation needed), not another block.
    all: u64,
    /// The same without the recall tool: what is compared where the client's block is sent as
    /// it is.
    but_recall: u64,
}

impl Names {
    fn of(names: &[&str]) -> Names {
        let hash = |names: &[&&str]| FixedState::with_seed(WHOLE_SEED).hash_one(names);
        let all: Vec<&&str> = names.iter().collect();
        let but_recall: Vec<&&str> = names.iter().filter(|n| **n != recall::TOOL_NAME).collect();
        Names {
            all: hash(&all),
            but_recall: hash(&but_recall),
        }
    }
}

/// What a point's whole rewrite sends besides its messages, when that is known without making
/// it (`Decide::known_at`).
#[derive(Debug, Clone, Copy)]
struct Known {
    names: Names,
    /// The digest of the block (`block_digest`), where the tools stage decides it.
    block: Option<u64>,
    tool_tokens: usize,
    /// Tokens of the definitions the tools stage places in the messages.
    placed_tokens: usize,
    reminder: bool,
}

impl crate::bounded::Weigh for Whole {
    fn heap_bytes(&self) -> usize {
        0
    }
}

/// Earlier requests replayed at most, when nothing is known of a conversation.
const MAX_REPLAY: usize = 256;

/// Seeds of the memo keys and digests of this module; bump `VERSION` when the decision rule
/// changes, so that remembered states of an older rule are not resumed from.
const VERSION: u64 = 4;
const SETTINGS_SEED: u64 = 0x7072_6566_6978_0001;
const STATE_SEED: u64 = 0x7072_6566_6978_0002;
const WHOLE_SEED: u64 = 0x7072_6566_6978_0003;
const REWRITE_SEED: u64 = 0x7072_6566_6978_0004;
const APPENDED_SEED: u64 = 0x7072_6566_6978_0005;

/// The rewrite of `request`: rebuilt whole, or the conversation's last whole rewrite with the
/// messages since appended (see the module doc).
pub fn run(request: &ChatRequest, env: &Env<'_>) -> Rewrite {
    if env.config.clear_at_least_tokens == 0 {
        return super::whole(request, env);
    }
    let settings = settings(request, env);
    let mut points = points(&request.messages, settings);
    if let [only] = points.as_mut_slice() {
        // With no earlier point, the store's sticky categories are an input too.
        only.digest = FixedState::with_seed(only.digest).hash_one(env.sticky_categories);
    }
    let current = points.len() - 1;
    let memo = env.memo;
    let cx = Decide::new(request, &points, env, settings);

    // Resume from the latest earlier point whose state is known: memoized here, or remembered.
    let mut anchor: Option<usize> = None;
    let mut from = 0;
    for k in (0..current).rev() {
        if let Some(known) = memo.peek::<usize>(points[k].digest ^ STATE_SEED) {
            anchor = Some(*known);
            from = k + 1;
            break;
        }
        let remembered = env
            .remembered
            .filter(|r| r.as_of == points[k].len && r.digest == points[k].digest)
            .and_then(|r| points[..=k].iter().position(|p| p.len == r.anchor));
        if let Some(known) = remembered {
            anchor = Some(known);
            from = k + 1;
            break;
        }
    }

    let mut long_history = false;
    if anchor.is_none() && current > MAX_REPLAY {
        long_history = true;
        from = current;
    }
    // The earlier points since then, each decided as it was when it was the last request.
    for (k, point) in points.iter().enumerate().take(current).skip(from) {
        let decided = match anchor {
            None => k,
            Some(a) => match cx.rebuild(a, k, &|| cx.whole_at(k)) {
                Some(_) => k,
                None => a,
            },
        };
        cx.keep_made(decided);
        anchor = Some(decided);
        memo.value(point.digest ^ STATE_SEED, || decided);
    }

    // The request itself: its whole rewrite is made only when rebuilding could pay (memoized:
    // the same request again costs no pipeline run).
    let whole = std::cell::OnceCell::new();
    let whole_now = || whole.get_or_init(|| cx.rewrite_at(current));
    let rebuilt = match anchor {
        None if long_history => Some(Rebuilt::LongHistory),
        None => Some(Rebuilt::First),
        Some(a) => cx.rebuild(a, current, &|| summary(whole_now())),
    };
    let anchor = match (rebuilt, anchor) {
        (None, Some(a)) => a,
        _ => current,
    };
    cx.keep_made(anchor);
    memo.value(points[current].digest ^ STATE_SEED, || anchor);
    let previous_tokens = current.checked_sub(1).map(|k| cx.tokens_at(points[k].len));
    let mut rewrite = if anchor == current {
        let mut rewrite = Rewrite::clone(whole_now());
        let summary = summary(&rewrite);
        memo.value(points[current].digest ^ WHOLE_SEED, || summary);
        rewrite.report.prefix = Some(PrefixReport {
            anchor_messages: points[current].len,
            appended_messages: 0,
            rebuilt,
            whole_tokens: Some(rewrite.report.tokens_after),
            previous_tokens,
        });
        rewrite
    } else {
        let anchored = cx.rewrite_at(anchor);
        let mut rewrite = appended(&anchored, request, points[anchor].len, env);
        // Where the client's block is sent as it is, the two differ by the recall tool at
        // most, and the anchor's block is the one its messages need.
        if let Some(whole) = whole
            .get()
            .filter(|w| !cx.tools_fixed && w.request.tools != anchored.request.tools)
        {
            let tokens = |r: &ChatRequest| {
                env.counter
                    .tools(r.tools.get().map_or(&[][..], Vec::as_slice))
            };
            let grown = tokens(&whole.request).saturating_sub(tokens(&rewrite.request));
            rewrite.request.tools = whole.request.tools.clone();
            rewrite.report.tokens_after += grown;
        }
        rewrite.report.prefix = Some(PrefixReport {
            anchor_messages: points[anchor].len,
            appended_messages: points[current].len - points[anchor].len,
            rebuilt: None,
            whole_tokens: whole.get().map(|w| w.report.tokens_after),
            previous_tokens,
        });
        rewrite
    };
    rewrite.request = sent_as(request, rewrite.request);
    // A request that is its conversation's only point leaves nothing to resume from: no later
    // request's point digests as it (its digest holds the sticky categories).
    rewrite.remember = (current > 0).then(|| PrefixState {
        anchor: points[anchor].len,
        as_of: points[current].len,
        digest: points[current].digest,
    });
    rewrite
}

/// The request sent: what the pipeline rewrites (messages, tools, `tool_choice`) from the
/// rewrite, everything else (model, stream, sampling, response format…) from the client's
/// request. A memoized rewrite was made by an earlier request with the same messages, whose
/// other fields may differ.
fn sent_as(current: &ChatRequest, rewritten: ChatRequest) -> ChatRequest {
    let mut sent = with_messages(std::borrow::Cow::Borrowed(current), rewritten.messages);
    if rewritten.tools.is_absent() && !current.tools.is_absent() {
        without_tools(&mut sent);
    } else {
        sent.tools = rewritten.tools;
        sent.tool_choice = rewritten.tool_choice;
    }
    sent
}

/// What every decision of one request reads.
struct Decide<'a> {
    request: &'a ChatRequest,
    points: &'a [Point],
    env: &'a Env<'a>,
    /// The digest of the request's settings (`settings`).
    settings: u64,
    /// The tools stage sends the client's block as it is: the tools never change.
    tools_fixed: bool,
    /// Each message's tokens as appended, by index, once known: a cold request's points sum
    /// the same messages many times, and each sum would hash the message again.
    appended: Vec<std::cell::OnceCell<usize>>,
    /// Each message's tokens but its content's (`TokenCounter::framing`), by index, once known.
    framing: Vec<std::cell::OnceCell<usize>>,
    /// The names and tokens of the client's tools, once read.
    client_block: std::cell::OnceCell<(Names, usize)>,
    /// The tokens of the client's first messages, by how many (`sums[i]`: the first `i`), as
    /// far as a point needed them: every point's whole rewrite starts from the tokens of its
    /// messages, and each message is looked up once per request.
    sums: std::cell::RefCell<Vec<usize>>,
    /// Whole rewrites this request made for earlier points, each with its point, while that
    /// point may still be the anchor (`Decide::whole_at`).
    made: std::cell::RefCell<Vec<(usize, Rewrite)>>,
    /// The copy of the request the points are decided on (`Decide::at`): its first messages.
    copy: std::cell::Cell<Option<ChatRequest>>,
    /// The tools stage's plan of the last point `known_at` read, for that point's whole
    /// rewrite, when it is made.
    planned: std::cell::Cell<Option<(usize, super::tools::Planned)>>,
}

#[cfg(test)]
thread_local! {
    /// Set by a test that makes every whole rewrite the floor would have left out.
    static FLOOR_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether decisions may be taken from the floor, without the whole rewrite (always, but in a
/// test that checks the floor against the whole).
fn floor_on() -> bool {
    #[cfg(test)]
    if FLOOR_OFF.get() {
        return false;
    }
    true
}

/// Tokens a whole rewrite may save below the sum of its parts' own counts (a system message's
/// sections joined to its text can merge a token or two at the seam).
const FLOOR_SLACK: usize = 16;

impl<'a> Decide<'a> {
    fn new(
        request: &'a ChatRequest,
        points: &'a [Point],
        env: &'a Env<'a>,
        settings: u64,
    ) -> Decide<'a> {
        Decide {
            request,
            points,
            env,
            settings,
            tools_fixed: sends_block_whole(request, env.config, env.counter),
            appended: vec![std::cell::OnceCell::new(); request.messages.len()],
            framing: vec![std::cell::OnceCell::new(); request.messages.len()],
            client_block: std::cell::OnceCell::new(),
            sums: std::cell::RefCell::new(vec![0]),
            made: std::cell::RefCell::new(Vec::new()),
            copy: std::cell::Cell::new(None),
            planned: std::cell::Cell::new(None),
        }
    }

    /// Whether the point `k` rebuilds its rewrite whole instead of appending to the anchor
    /// `a`'s; `whole_k` makes the whole rewrite's summary, only when the floor leaves it open.
    fn rebuild(&self, a: usize, k: usize, whole_k: &dyn Fn() -> Whole) -> Option<Rebuilt> {
        let (points, env) = (self.points, self.env);
        let anchored = self.whole_at(a);
        let appended = anchored.tokens
            + (points[a].len..points[k].len)
                .map(|i| self.appended_at(i))
                .sum::<usize>();
        let threshold = env.config.clear_at_least_tokens;
        let budget_on = env.config.budget.enabled;
        // The whole rewrite is never smaller than what no step cuts: when that floor leaves less
        // than the threshold to remove, and the budget cannot be met by rebuilding either, the
        // answer is known without making it, once its tools and reminder are known to be the
        // anchor's.
        let current = k + 1 == points.len();
        if floor_on()
            && let Some(known) = self.known_at(k)
        {
            let same_block = self.names(known.names) == self.names(anchored.names);
            // The request itself appends with the whole rewrite's tools where the stage
            // promoted one in place (`run`): only the anchor's own block is sent without it.
            let sent_as_anchored = !current || known.block.is_none_or(|b| b == anchored.block);
            let reminder_starts = known.reminder && !anchored.reminder;
            if same_block && sent_as_anchored && !reminder_starts {
                let settled = |floor: usize| {
                    let may_pay = appended >= floor.saturating_add(threshold);
                    let may_fit = budget_on && appended > env.budget && floor <= env.budget;
                    !may_pay && !may_fit
                };
                // The framing of the last turn's results is counted only where the rest of the
                // floor leaves the answer open.
                let (floor, framed) = self.floor(points[k].len, &known);
                let less_slack = |tokens: usize| tokens.saturating_sub(FLOOR_SLACK);
                if settled(less_slack(floor)) || settled(less_slack(floor + framed())) {
                    return None;
                }
            }
        }
        let whole = whole_k();
        if self.names(whole.names) != self.names(anchored.names) {
            return Some(Rebuilt::ToolsChanged);
        }
        if whole.reminder && !anchored.reminder {
            return Some(Rebuilt::ReminderStarted);
        }
        if appended >= whole.tokens.saturating_add(threshold) {
            return Some(Rebuilt::Pays);
        }
        let over = budget_on && appended > env.budget;
        (over && whole.fits).then_some(Rebuilt::Budget)
    }

    /// What the decisions read of the whole rewrite at point `k`, memoized (the rewrite itself
    /// is memoized only for a point that a request appends to: `rewrite_at`). A rewrite made
    /// here is kept, once per point, until the decisions leave its point behind (`keep_made`):
    /// the point that becomes the anchor is the one the request then appends to, and it is not
    /// made twice.
    fn whole_at(&self, k: usize) -> Whole {
        let (points, env) = (self.points, self.env);
        *env.memo.value(points[k].digest ^ WHOLE_SEED, || {
            let known = env.memo.peek_rewrite(points[k].digest ^ REWRITE_SEED);
            // Made already by this request, its summary evicted since: read again, not made.
            let made = (self.made.borrow().iter())
                .find(|(j, _)| *j == k)
                .map(|(_, rewrite)| summary(rewrite));
            match (known, made) {
                (Some(rewrite), _) => summary(&rewrite),
                (None, Some(whole)) => whole,
                (None, None) => {
                    let rewrite = self.whole_of(k);
                    let whole = summary(&rewrite);
                    self.made.borrow_mut().push((k, rewrite));
                    whole
                }
            }
        })
    }

    /// Drops the rewrites made for points other than the anchor `anchor`.
    fn keep_made(&self, anchor: usize) {
        self.made.borrow_mut().retain(|(k, _)| *k == anchor);
    }

    /// The whole rewrite at point `k`, memoized: the one `whole_at` made, when it did, with its
    /// report's `over_budget` (a rewrite made only to decide goes without).
    fn rewrite_at(&self, k: usize) -> Arc<Rewrite> {
        let (points, env) = (self.points, self.env);
        let made = {
            let mut made = self.made.borrow_mut();
            made.iter()
                .position(|(j, _)| *j == k)
                .map(|at| made.swap_remove(at).1)
        };
        env.memo.rewrite(points[k].digest ^ REWRITE_SEED, || {
            made.unwrap_or_else(|| self.whole_of(k))
                .with_over_budget(env)
        })
    }

    /// The whole rewrite of the request as it was at point `k`.
    fn whole_of(&self, k: usize) -> Rewrite {
        let tokens = self.tokens_at(self.points[k].len);
        let planned = (self.planned.take())
            .filter(|(j, _)| *j == k)
            .map(|(_, planned)| planned);
        self.at(k, |truncated, env| {
            super::whole_counted(truncated, env, tokens, planned)
        })
    }

    /// `f` of the request as it was at point `k` and of the point's environment (`env_at`).
    /// One copy of the client's request serves every point: each message is copied once, when
    /// a point first needs it, and the later ones are set aside while `f` runs (copying a long
    /// history for each of its points would cost more than deciding them).
    fn at<R>(&self, k: usize, f: impl FnOnce(&ChatRequest, &Env<'_>) -> R) -> R {
        let (request, points) = (self.request, self.points);
        let len = points[k].len;
        // Taken while lent: a point decided within another's `f` gets a copy of its own.
        let mut copy = self
            .copy
            .take()
            .unwrap_or_else(|| with_messages(std::borrow::Cow::Borrowed(request), Vec::new()));
        let copied = copy.messages.len();
        if copied < len {
            copy.messages
                .extend_from_slice(&request.messages[copied..len]);
        }
        let later: Vec<Message> = copy.messages.drain(len..).collect();
        let mut sticky = Vec::new();
        let env = env_at(&copy, points.len() == 1, self.env, &mut sticky);
        let result = f(&copy, &env);
        copy.messages.extend(later);
        self.copy.set(Some(copy));
        result
    }

    /// The tokens of the client's request as it was with its first `len` messages
    /// (`TokenCounter::request` of it).
    fn tokens_at(&self, len: usize) -> usize {
        let counter = self.env.counter;
        let mut sums = self.sums.borrow_mut();
        let counted = sums.len() - 1;
        for message in self.request.messages.get(counted..len).unwrap_or_default() {
            let before = sums.last().copied().unwrap_or_default();
            sums.push(before + counter.message(message));
        }
        let tools = self.request.tools.get().map_or(&[][..], Vec::as_slice);
        counter.request_of(sums[len], tools)
    }

    /// The tokens of the request's message `index` as it is appended.
    fn appended_at(&self, index: usize) -> usize {
        let message = &self.request.messages[index];
        *self.appended[index].get_or_init(|| appended_tokens(message, self.settings, self.env))
    }

    /// The tokens of message `index` but its content's, memoized like `appended_at`.
    fn framing_at(&self, index: usize) -> usize {
        let message = &self.request.messages[index];
        *self.framing[index].get_or_init(|| self.env.counter.framing(message))
    }

    /// What is compared of two rewrites' tools: a tool promoted in place (the re-ask of a
    /// strict stub did it already) is appended to, with the whole rewrite's tools; another
    /// block is rebuilt. The recall tool joining the client's own block is not another block
    /// (see the module doc).
    fn names(&self, names: Names) -> u64 {
        if self.tools_fixed {
            names.but_recall
        } else {
            names.all
        }
    }

    /// The tools the whole rewrite at point `k` sends, and whether it starts the reminder,
    /// without making it: the client's block where the tools stage sends it as it is (the
    /// recall tool, which the compaction may add, left out), or the block the stage decides
    /// from the point's history, with the recall tool a decided block always offers. `None`
    /// where the stage decides to send the client's block after all: whether the recall tool
    /// joins it is the compaction's to say.
    fn known_at(&self, k: usize) -> Option<Known> {
        let env = self.env;
        let reminder = env
            .reinforcement
            .and_then(|r| {
                super::reinforcement::reminder(&self.request.messages[..self.points[k].len], r)
            })
            .is_some();
        let client_tools = self.request.tools.get().map_or(&[][..], Vec::as_slice);
        if self.tools_fixed {
            let (names, tool_tokens) = *self.client_block.get_or_init(|| {
                let names = Names::of(&self.request.tool_names());
                (names, env.counter.tools(client_tools))
            });
            return Some(Known {
                names,
                block: None,
                tool_tokens,
                placed_tokens: 0,
                reminder,
            });
        }
        let planned = self.at(k, super::tools::planned)?;
        let known = self.known_of(&planned, reminder);
        self.planned.set(Some((k, planned)));
        known
    }

    /// `known_at` of a point whose block the tools stage decides, from its plan.
    fn known_of(&self, planned: &super::tools::Planned, reminder: bool) -> Option<Known> {
        let env = self.env;
        let client_tools = self.request.tools.get().map_or(&[][..], Vec::as_slice);
        let mut tools = planned.sent()?.to_vec();
        // A decided block always offers the recall tool where it may (`run_stages_into`).
        if recall::enabled(env.config) && recall::can_offer_beside(&tools, client_tools) {
            recall::offer_in(&mut tools);
        }
        let names: Vec<&str> = (tools.iter())
            .filter_map(|t| t.function.as_ref().map(|f| f.name.as_str()))
            .collect();
        let names = Names::of(&names);
        let tool_tokens = env.counter.tools(&tools);
        let sent = if tools.is_empty() {
            Nullable::Absent
        } else {
            Nullable::Value(tools)
        };
        Some(Known {
            names,
            block: Some(block_digest(&sent)),
            tool_tokens,
            placed_tokens: planned.placed().map(|m| env.counter.message(m)).sum(),
            reminder,
        })
    }

    /// A lower bound of the whole rewrite of the first `len` messages, whichever budget step
    /// it ends at: its tools and the definitions placed beside them (`known`), the first system
    /// message (verbatim), the working set (in the form a whole rewrite keeps it, which is the
    /// appended form) and the assistant messages of the last turn (every window keeps that
    /// turn, and only tool results are compacted); and what it adds, made when asked: the
    /// framing of the last turn's other results (a stub or a cut keeps a result's role, name
    /// and call id). Their sum less `FLOOR_SLACK` is the bound.
    fn floor(&self, len: usize, known: &Known) -> (usize, impl FnOnce() -> usize + '_) {
        let env = self.env;
        let messages = &self.request.messages[..len];
        let system = messages
            .iter()
            .find(|m| matches!(m.role, Role::System | Role::Developer))
            .map_or(0, |m| env.counter.message(m));
        let working_set = WorkingSet::of(messages, env.config.window.recent_tool_steps);
        let last_turn = working_set.last_user.unwrap_or(len);
        let kept: usize = messages
            .iter()
            .enumerate()
            .filter(|(i, m)| match m.role {
                Role::System | Role::Developer => false,
                Role::Assistant if *i > last_turn => true,
                _ => working_set.contains(*i),
            })
            .map(|(i, _)| self.appended_at(i))
            .sum();
        // The last turn's other results are sent too, each in some form: its framing at least.
        let framed = move || {
            (last_turn + 1..len)
                .filter(|&i| {
                    matches!(messages[i].role, Role::Tool | Role::Function)
                        && !working_set.contains(i)
                })
                .map(|i| self.framing_at(i))
                .sum()
        };
        (
            known.tool_tokens + known.placed_tokens + system + kept,
            framed,
        )
    }
}

/// The requests of a conversation its history shows: before each assistant message that
/// follows a user turn (and is not a second assistant message in a row), and the request
/// itself, last.
fn points(messages: &[Message], settings: u64) -> Vec<Point> {
    let mut hasher = FixedState::with_seed(settings).build_hasher();
    let mut points = Vec::new();
    let mut earlier = earlier_points(messages).peekable();
    for (index, message) in messages.iter().enumerate() {
        if earlier.next_if_eq(&index).is_some() {
            points.push(Point {
                len: index,
                digest: hasher.clone().finish(),
            });
        }
        hash_exactly(message, &mut hasher);
    }
    points.push(Point {
        len: messages.len(),
        digest: hasher.finish(),
    });
    points
}

/// The lengths of the earlier requests that `messages` show (see `points`), in order.
fn earlier_points(messages: &[Message]) -> impl Iterator<Item = usize> + '_ {
    let first_user = messages.iter().position(|m| m.role == Role::User);
    messages
        .windows(2)
        .enumerate()
        .filter(move |(before, pair)| {
            first_user.is_some_and(|user| user <= *before)
                && pair[0].role != Role::Assistant
                && pair[1].role == Role::Assistant
        })
        .map(|(before, _)| before + 1)
}

/// Whether the history of `messages` shows an earlier request of its conversation. Without
/// one the request is its conversation's only point: a remembered state decides nothing for it
/// (there is no earlier point to resume from), and it leaves none (`run`).
pub fn has_earlier_point(messages: &[Message]) -> bool {
    earlier_points(messages).next().is_some()
}

/// Feeds everything of a message to `hasher`: what `hash_message` reads, and the fields a
/// rewrite copies without reading (ids of tool calls, fields ctxproxy does not know), since a
/// memoized rewrite is reused by any request whose points hash the same. Texts go in by their
/// bytes: the digests of points are kept in the store, for replicas of any version.
fn hash_exactly(message: &Message, hasher: &mut impl Hasher) {
    hash_message_stored(message, hasher);
    let extra = |extra: &crate::openai::Extra, hasher: &mut _| {
        if !extra.is_empty() {
            serde_json::to_string(extra)
                .unwrap_or_default()
                .hash(hasher);
        }
    };
    extra(&message.extra, hasher);
    for call in message.tool_calls() {
        (&call.id, &call.kind).hash(hasher);
        extra(&call.extra, hasher);
    }
    if let Some(crate::openai::Content::Parts(parts)) = message.content.get() {
        for part in parts.iter().filter(|p| p.text.get().is_some()) {
            extra(&part.extra, hasher);
        }
    }
}

/// Everything a rewrite depends on besides the messages: the request's other fields that the
/// stages read, the encoding, the budget and the pipeline's settings.
fn settings(request: &ChatRequest, env: &Env<'_>) -> u64 {
    let mut hasher = FixedState::with_seed(SETTINGS_SEED).build_hasher();
    VERSION.hash(&mut hasher);
    env.counter.encoding().hash(&mut hasher);
    env.budget.hash(&mut hasher);
    // Not serialized with `[tools]`: set per upstream.
    env.config.tools.definitions.hash(&mut hasher);
    for part in written(env.config, env.reinforcement).iter() {
        part.hash(&mut hasher);
    }
    (serde_json::to_string(&request.tool_choice).unwrap_or_default()).hash(&mut hasher);
    hash_block(&request.tools, &mut hasher);
    hasher.finish()
}

/// A route's settings as `settings` reads them, written out (JSON): the config, its `[tools]`
/// and the reinforcement.
type Written = Rc<[String; 3]>;

/// Configs written out lately, per thread: a route's config is the same on every request, and
/// writing it out costs more than the rest of a small request's rewrite.
struct Kept {
    config: PipelineConfig,
    reinforcement: Option<ReinforcementConfig>,
    written: Written,
}

/// How many configs each thread keeps written out (a route has a few: `Upstream::pipeline`).
const WRITTEN_KEPT: usize = 8;

thread_local! {
    static WRITTEN: std::cell::RefCell<Vec<Kept>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The config's floats, bit for bit: configs that are equal but for the sign of a zero are
/// written out differently.
fn float_bits(config: &PipelineConfig) -> [u64; 5] {
    let (tools, window) = (&config.tools, &config.window);
    [
        tools.context_weight,
        tools.min_score,
        window.continuity_high,
        window.continuity_low,
        window.topic_shift_similarity,
    ]
    .map(f64::to_bits)
}

/// `config` and `reinforcement` written out, or as kept when equal to a config written before.
fn written(config: &PipelineConfig, reinforcement: Option<&ReinforcementConfig>) -> Written {
    WRITTEN.with_borrow_mut(|kept| {
        let same = |k: &Kept| {
            k.config == *config
                && float_bits(&k.config) == float_bits(config)
                && k.reinforcement.as_ref() == reinforcement
        };
        if let Some(found) = kept.iter().find(|k| same(k)) {
            return Rc::clone(&found.written);
        }
        let written = Rc::new([
            serde_json::to_string(config).unwrap_or_default(),
            serde_json::to_string(&config.tools).unwrap_or_default(),
            serde_json::to_string(&reinforcement).unwrap_or_default(),
        ]);
        if kept.len() == WRITTEN_KEPT {
            kept.remove(0);
        }
        kept.push(Kept {
            config: config.clone(),
            reinforcement: reinforcement.cloned(),
            written: Rc::clone(&written),
        });
        written
    })
}

/// The digest of a block of tools, definitions and all.
fn block_digest(tools: &Nullable<Vec<Tool>>) -> u64 {
    let mut hasher = FixedState::with_seed(WHOLE_SEED).build_hasher();
    hash_block(tools, &mut hasher);
    hasher.finish()
}

/// Feeds everything of a tool block to `hasher`, as writing it out would: absent, `null` or
/// each tool's every field (a schema by its content hash, computed once per block read).
fn hash_block(tools: &Nullable<Vec<Tool>>, hasher: &mut impl Hasher) {
    // Every part that may be left out is preceded by what says whether it follows, so no two
    // blocks feed the same sequence.
    let extra = |extra: &crate::openai::Extra, hasher: &mut _| {
        extra.len().hash(hasher);
        if !extra.is_empty() {
            serde_json::to_string(extra)
                .unwrap_or_default()
                .hash(hasher);
        }
    };
    let tools = match tools {
        Nullable::Absent => return 0u8.hash(hasher),
        Nullable::Null => return 1u8.hash(hasher),
        Nullable::Value(tools) => tools,
    };
    (2u8, tools.len()).hash(hasher);
    for tool in tools {
        tool.kind.hash(hasher);
        extra(&tool.extra, hasher);
        let Some(function) = &tool.function else {
            0u8.hash(hasher);
            continue;
        };
        1u8.hash(hasher);
        function.name.hash(hasher);
        // The text, not its digest: what the store keeps is digested as before.
        nullable_hash(&function.description, hasher, |d, h| d.as_str().hash(h));
        nullable_hash(&function.parameters, hasher, |p, h| {
            p.content_hash().hash(h)
        });
        extra(&function.extra, hasher);
    }
}

/// Feeds which of absent, `null` or a value `field` is to `hasher`, and the value by `hash`.
fn nullable_hash<T, H: Hasher>(field: &Nullable<T>, hasher: &mut H, hash: impl Fn(&T, &mut H)) {
    match field {
        Nullable::Absent => 0u8.hash(hasher),
        Nullable::Null => 1u8.hash(hasher),
        Nullable::Value(value) => {
            2u8.hash(hasher);
            hash(value, hasher);
        }
    }
}

/// The environment of a point, `truncated` the request as it was there: the sticky categories
/// are those its history shows (what a client sending its whole history carries itself), so
/// every replica decides the same; the store's only count for a conversation with no earlier
/// point (`only_point`).
fn env_at<'b>(
    truncated: &ChatRequest,
    only_point: bool,
    env: &Env<'b>,
    sticky: &'b mut Vec<String>,
) -> Env<'b> {
    if only_point {
        return *env;
    }
    *sticky = previous_turn_categories(truncated, env.config, env.memo);
    Env {
        sticky_categories: sticky,
        ..*env
    }
}

fn summary(rewrite: &Rewrite) -> Whole {
    Whole {
        tokens: rewrite.report.tokens_after,
        names: Names::of(&rewrite.request.tool_names()),
        block: block_digest(&rewrite.request.tools),
        reminder: rewrite
            .report
            .stages
            .iter()
            .any(|s| s.stage == StageName::Reinforcement),
        fits: rewrite.report.fits,
    }
}

/// The tokens of a message as it is appended, memoized by its content and the settings.
fn appended_tokens(message: &Message, settings: u64, env: &Env<'_>) -> usize {
    let mut hasher = FixedState::with_seed(APPENDED_SEED ^ settings).build_hasher();
    hash_message(message, &mut hasher);
    *env.memo.value(hasher.finish(), || {
        compact::appended(message, env.config, env.counter, env.memo)
            .map_or_else(|| env.counter.message(message), |m| env.counter.message(&m))
    })
}

/// The anchor's rewrite with the request's messages from `from` on appended. Its report
/// shifts the anchor's stages by the appended messages as sent and adds a stage `append` for
/// what appending saved, so the stages still sum to the whole saving.
fn appended(anchored: &Rewrite, request: &ChatRequest, from: usize, env: &Env<'_>) -> Rewrite {
    let counter = env.counter;
    let mut sent = anchored.request.clone();
    let (mut before, mut after, mut compacted) = (0, 0, 0);
    // Tools needed since are defined where the need arose, as the whole rewrite would.
    let definitions =
        definitions_from(request, from, &sent.messages, env.config, counter, env.memo);
    let defined = definitions.names;
    let definitions = definitions.placed;
    let mut definitions = definitions.into_iter().peekable();
    for (index, message) in request.messages.iter().enumerate().skip(from) {
        while let Some((_, defined)) = definitions.next_if(|(at, _)| *at <= index) {
            after += counter.message(&defined);
            sent.messages.push(defined);
        }
        before += counter.message(message);
        let message = match compact::appended(message, env.config, counter, env.memo) {
            Some(smaller) => {
                compacted += 1;
                smaller
            }
            None => message.clone(),
        };
        after += counter.message(&message);
        sent.messages.push(message);
    }
    for (_, defined) in definitions {
        after += counter.message(&defined);
        sent.messages.push(defined);
    }
    let details = AppendDetails {
        appended: request.messages.len() - from,
        compacted,
    };
    Rewrite::appended(anchored, sent, (before, after), details, &defined, env)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guards::ReinforcementConfig;
    use crate::pipeline::{Memo, PipelineConfig, run};
    use crate::synthetic;
    use crate::tokens::{Encoding, TokenCounter};

    #[test]
    fn a_tool_block_hashes_apart_from_any_block_written_otherwise() {
        let digest = |tools: serde_json::Value| {
            let body = serde_json::json!({"model": "m", "messages": [], "tools": tools});
            let mut body = body.as_object().unwrap().clone();
            if tools.is_string() {
                body.remove("tools");
            }
            let chat: ChatRequest = serde_json::from_value(body.into()).unwrap();
            let mut hasher = FixedState::with_seed(1).build_hasher();
            hash_block(&chat.tools, &mut hasher);
            hasher.finish()
        };
        let tool = |function: serde_json::Value| serde_json::json!([{"type": "function", "function": function}]);
        let blocks = [
            serde_json::json!("absent"),
            serde_json::Value::Null,
            serde_json::json!([]),
            tool(serde_json::json!({"name": "f"})),
            tool(serde_json::json!({"name": "g"})),
            tool(serde_json::json!({"name": "f", "description": null})),
            tool(serde_json::json!({"name": "f", "description": "d"})),
            tool(serde_json::json!({"name": "f", "parameters": null})),
            tool(serde_json::json!({"name": "f", "parameters": {"type": "object"}})),
            tool(serde_json::json!({"name": "f", "parameters": {"type": "array"}})),
            tool(serde_json::json!({"name": "f", "strict": true})),
            serde_json::json!([{"type": "function", "function": {"name": "f"}, "x": 1}]),
            serde_json::json!([{"type": "web_search"}]),
            serde_json::json!([{"type": "function", "function": {"name": "f"}}, {"type": "web_search"}]),
            serde_json::json!([{"type": "web_search"}, {"type": "function", "function": {"name": "f"}}]),
            // One tool's last fields and the next tool's first must not run together.
            serde_json::json!([{"type": "function", "function": {"name": "f", "strict": true}}, {"type": "{\"x\":1}"}]),
            serde_json::json!([{"type": "function", "function": {"name": "f"}}, {"type": "{\"strict\":true}", "x": 1}]),
        ];
        let digests: std::collections::HashSet<u64> = blocks.iter().cloned().map(digest).collect();
        assert_eq!(digests.len(), blocks.len());
        assert_eq!(digest(blocks[8].clone()), digest(blocks[8].clone()));
    }

    fn env<'a>(
        config: &'a PipelineConfig,
        counter: &'a TokenCounter,
        memo: &'a Memo,
        remembered: Option<PrefixState>,
    ) -> Env<'a> {
        Env {
            config,
            counter,
            memo,
            budget: 4_000,
            sticky_categories: &[],
            reinforcement: None,
            remembered,
        }
    }

    #[test]
    fn a_stored_state_digests_as_every_version_before() {
        // Replicas of another version read and write the same states in the store: a change
        // here is a change of what is stored (bump `VERSION` with it, deliberately).
        let mut previous = synthetic::autonomous_agent(12).unwrap();
        previous.messages.truncate(previous.messages.len() - 2);
        let (config, counter, memo) = (
            PipelineConfig::default(),
            TokenCounter::new(Encoding::O200kBase),
            Memo::default(),
        );
        let env = Env {
            budget: 10_000_000,
            ..env(&config, &counter, &memo, None)
        };
        let remember = run(&previous, &env).remember.unwrap();
        assert_eq!((remember.anchor, remember.as_of), (24, 24));
        assert_eq!(remember.digest, 9_922_026_197_369_008_435);
    }

    #[test]
    fn settings_kept_written_are_the_settings_written_out() {
        let first = PipelineConfig::default();
        let mut other = first.clone();
        other.window.ledger_max_tokens += 1;
        let (mut zero, mut negative_zero) = (first.clone(), first.clone());
        zero.window.continuity_low = 0.0;
        negative_zero.window.continuity_low = -0.0;
        let reminder = ReinforcementConfig::default();
        for (config, reinforcement) in [
            (&first, None),
            (&other, None),
            (&first, Some(&reminder)),
            (&first, None),
            (&zero, None),
            (&negative_zero, None),
        ] {
            let written_out = [
                serde_json::to_string(config).unwrap(),
                serde_json::to_string(&config.tools).unwrap(),
                serde_json::to_string(&reinforcement).unwrap(),
            ];
            assert_eq!(*written(config, reinforcement), written_out);
        }
    }

    #[test]
    fn every_float_of_a_config_is_compared_bit_for_bit() {
        fn floats(value: &serde_json::Value) -> usize {
            match value {
                serde_json::Value::Number(n) => usize::from(n.is_f64()),
                serde_json::Value::Array(items) => items.iter().map(floats).sum(),
                serde_json::Value::Object(fields) => fields.values().map(floats).sum(),
                _ => 0,
            }
        }
        let config = PipelineConfig::default();
        let written = [
            serde_json::to_value(&config).unwrap(),
            serde_json::to_value(&config.tools).unwrap(),
            serde_json::to_value(ReinforcementConfig::default()).unwrap(),
        ];
        assert_eq!(
            written.iter().map(floats).sum::<usize>(),
            float_bits(&config).len()
        );
    }

    /// The reasons of the rebuilt rewrites of a conversation replayed with `budget`.
    fn rebuilds(requests: &[ChatRequest], budget: usize) -> Vec<Option<Rebuilt>> {
        let config = PipelineConfig::default();
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        let env = Env {
            budget,
            ..env(&config, &counter, &memo, None)
        };
        requests
            .iter()
            .map(|r| run(r, &env).report.prefix.and_then(|p| p.rebuilt))
            .collect()
    }

    /// The requests of a synthetic conversation, in order, as its client sent them.
    fn requests(turns: usize) -> Vec<ChatRequest> {
        requests_of(&synthetic::conversation(turns).unwrap())
    }

    /// The request as it was at point `point`.
    fn request_at(request: &ChatRequest, point: Point) -> ChatRequest {
        with_messages(
            std::borrow::Cow::Borrowed(request),
            request.messages[..point.len].to_vec(),
        )
    }

    /// The requests whose last is `full`, in order, as its client sent them.
    fn requests_of(full: &ChatRequest) -> Vec<ChatRequest> {
        points(&full.messages, 0)
            .into_iter()
            .map(|point| request_at(full, point))
            .collect()
    }

    #[test]
    fn points_are_the_requests_the_history_shows() {
        let full = synthetic::conversation(3).unwrap();
        let lens: Vec<usize> = points(&full.messages, 0).iter().map(|p| p.len).collect();
        // system, user, call, result, answer, user, call, result, answer, user, answer, user:
        // before each answer or call, and the whole request.
        assert_eq!(lens, vec![2, 4, 6, 8, 10, 12]);
        let roles = |len: usize| full.messages[len].role.clone();
        assert!(lens[..5].iter().all(|&len| roles(len) == Role::Assistant));
    }

    /// The lengths of the earlier requests, as `points` first found them: one loop, a flag.
    fn earlier_points_as_first_written(messages: &[Message]) -> Vec<usize> {
        let mut lens = Vec::new();
        let mut seen_user = false;
        for (index, message) in messages.iter().enumerate() {
            let after_other = index > 0 && messages[index - 1].role != Role::Assistant;
            if seen_user && after_other && message.role == Role::Assistant {
                lens.push(index);
            }
            seen_user |= message.role == Role::User;
        }
        lens
    }

    #[test]
    fn an_earlier_point_is_an_answer_or_call_after_a_user_turn() {
        let roles = [
            Role::System,
            Role::Developer,
            Role::User,
            Role::Assistant,
            Role::Tool,
            Role::Function,
            Role::Other("x".into()),
        ];
        // Every history of up to 6 messages over every role.
        let mut histories: Vec<Vec<Message>> = vec![Vec::new()];
        let mut last: Vec<Vec<Message>> = vec![Vec::new()];
        for _ in 0..6 {
            last = last
                .iter()
                .flat_map(|h| {
                    roles.iter().map(move |role| {
                        let mut longer = h.clone();
                        longer.push(Message::text(role.clone(), "x"));
                        longer
                    })
                })
                .collect();
            histories.extend(last.iter().cloned());
        }
        for messages in &histories {
            let expected = earlier_points_as_first_written(messages);
            assert_eq!(earlier_points(messages).collect::<Vec<_>>(), expected);
            assert_eq!(has_earlier_point(messages), !expected.is_empty());
            let lens: Vec<usize> = points(messages, 0).iter().map(|p| p.len).collect();
            assert_eq!(lens[..lens.len() - 1], expected[..]);
        }
    }

    #[test]
    fn a_conversations_only_point_leaves_no_state_to_resume_from() {
        let (config, counter, memo) = (
            PipelineConfig::default(),
            TokenCounter::new(Encoding::O200kBase),
            Memo::default(),
        );
        let env = env(&config, &counter, &memo, None);
        let all = requests(3);
        assert_eq!(run(&all[0], &env).remember, None);
        let second = run(&all[1], &env).remember.unwrap();
        assert_eq!(second.as_of, all[1].messages.len());
    }

    #[test]
    fn turns_are_appended_between_recompactions_that_pay() {
        let config = PipelineConfig::default();
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        let (mut appended, mut paid) = (0, 0);
        let mut previous: Option<ChatRequest> = None;
        for request in requests(40) {
            let rewrite = run(&request, &env(&config, &counter, &memo, None));
            let prefix = rewrite.report.prefix.clone().unwrap();
            let sent = &rewrite.request;
            match (prefix.rebuilt, &previous) {
                (None, Some(before)) => {
                    appended += 1;
                    // The previous rewrite, byte for byte, then the new messages.
                    assert_eq!(sent.tool_names(), before.tool_names());
                    assert_eq!(sent.tools, before.tools);
                    assert!(sent.messages.starts_with(&before.messages));
                    // Rebuilding would not have paid, and the budget is not what it breaks.
                    assert!(prefix.whole_tokens.is_none_or(|whole| {
                        rewrite.report.tokens_after < whole + config.clear_at_least_tokens
                    }));
                }
                (Some(Rebuilt::Pays), _) => paid += 1,
                (Some(Rebuilt::First), None) => {}
                (Some(other), _) => assert!(
                    matches!(other, Rebuilt::Budget | Rebuilt::ToolsChanged),
                    "{other:?}"
                ),
                (None, None) => panic!("the first request appends to nothing"),
            }
            assert!(rewrite.report.tokens_after <= rewrite.report.tokens_before);
            previous = Some(rewrite.request);
        }
        assert!(appended > 40, "{appended} appended");
        assert!(paid > 0, "no recompaction paid");
    }

    #[test]
    fn without_budget_pressure_only_savings_rebuild() {
        let requests = requests(40);
        let reasons = rebuilds(&requests, 1_000_000);
        assert_eq!(reasons[0], Some(Rebuilt::First));
        let paid = reasons
            .iter()
            .filter(|r| **r == Some(Rebuilt::Pays))
            .count();
        let appended = reasons.iter().filter(|r| r.is_none()).count();
        assert!(paid >= 1 && appended > 4 * paid, "{reasons:?}");
        // The tool block may grow; the budget never rebuilds.
        assert!(
            reasons[1..]
                .iter()
                .all(|r| matches!(r, None | Some(Rebuilt::Pays | Rebuilt::ToolsChanged))),
            "{reasons:?}"
        );
        // A larger threshold rebuilds less often.
        let config = PipelineConfig {
            clear_at_least_tokens: 6_000,
            ..PipelineConfig::default()
        };
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        let env = Env {
            budget: 1_000_000,
            ..env(&config, &counter, &memo, None)
        };
        let fewer = requests
            .iter()
            .filter(|r| run(r, &env).report.prefix.and_then(|p| p.rebuilt) == Some(Rebuilt::Pays))
            .count();
        assert!(fewer < paid, "{fewer} vs {paid}");
    }

    /// A memo that keeps nothing: every value and rewrite is made again where it is needed.
    fn forgetful_memo() -> Memo {
        Memo::new(&crate::bounded::MemoryConfig {
            memo_max_bytes: 1,
            rewrites_max_bytes: 1,
            ..Default::default()
        })
    }

    #[test]
    fn a_memo_that_keeps_nothing_gives_the_same_rewrites() {
        // Every earlier point replayed cold reads its anchor's summary again; with nothing
        // kept, the rewrite this request made for the anchor is read, not made once more.
        let config = PipelineConfig::default();
        let counter = TokenCounter::new(Encoding::O200kBase);
        for request in requests(30).iter().step_by(7) {
            let kept = run(request, &env(&config, &counter, &Memo::default(), None));
            let forgot = run(request, &env(&config, &counter, &forgetful_memo(), None));
            assert_eq!(forgot.request, kept.request);
            assert_eq!(forgot.remember, kept.remember);
            assert_eq!(forgot.report.prefix, kept.report.prefix);
        }
    }

    #[test]
    fn the_decisions_are_the_same_without_the_memo_and_from_a_remembered_state() {
        let config = PipelineConfig::default();
        let counter = TokenCounter::new(Encoding::O200kBase);
        let warm = Memo::default();
        let requests = requests(25);
        let mut remembered = None;
        let mut last = None;
        for request in &requests {
            let rewrite = run(request, &env(&config, &counter, &warm, None));
            remembered = rewrite.remember;
            last = Some(rewrite.request);
        }
        let last = last.unwrap();
        let (current, before) = (&requests[requests.len() - 1], &requests[requests.len() - 2]);
        let cold = run(current, &env(&config, &counter, &Memo::default(), None));
        assert_eq!(cold.request, last);

        // The state the store holds after the request before is a point to resume from.
        let stored = run(before, &env(&config, &counter, &Memo::default(), None)).remember;
        let resumed = run(current, &env(&config, &counter, &Memo::default(), stored));
        assert_eq!(resumed.request, last);
        assert_eq!(resumed.remember, remembered);
        // One of another conversation (or an edited history) is not.
        let wrong = stored.map(|s| PrefixState {
            digest: s.digest ^ 1,
            ..s
        });
        let ignored = run(current, &env(&config, &counter, &Memo::default(), wrong));
        assert_eq!(ignored.request, last);
    }

    /// A reminder that starts within the fixtures of the floor's tests.
    fn floor_reminder() -> ReinforcementConfig {
        ReinforcementConfig {
            enabled: true,
            after_messages: 30,
            text: "Follow the policy.".into(),
        }
    }

    /// The configs the floor's tests run. Small blocks are sent as they are, and the recall tool
    /// joins them; with no block or definition small, the tools stage decides a block of stubs
    /// and the tools the conversation's first turn needs; then the same with what else decides
    /// the block sent: the recall tool off, left-out tools removed, definitions grown in the
    /// block or given as a call's result.
    fn floor_configs() -> Vec<PipelineConfig> {
        let mut decided = PipelineConfig::default();
        decided.tools.min_tool_tokens = 0;
        decided.tools.min_stub_tokens = 0;
        let mut configs = vec![PipelineConfig::default(), decided.clone()];
        for change in [
            (|c: &mut PipelineConfig| c.compact.recall = false) as fn(&mut PipelineConfig),
            |c| c.tools.left_out = crate::pipeline::config::LeftOut::Remove,
            |c| c.tools.definitions = crate::pipeline::config::Definitions::InBlock,
            |c| c.tools.definitions = crate::pipeline::config::Definitions::InResult,
        ] {
            let mut variant = decided.clone();
            change(&mut variant);
            configs.push(variant);
        }
        configs
    }

    #[test]
    fn the_floor_never_changes_a_decision() {
        let reminder = floor_reminder();
        let chat = requests(40);
        let agent = requests_of(&synthetic::autonomous_agent(30).unwrap());
        let budgets = [
            (2_000, None),
            (4_000, None),
            (1_000_000, None),
            (1_000_000, Some(&reminder)),
        ];
        for (index, config) in floor_configs().iter().enumerate() {
            let mut left_out = 0;
            for (requests, (budget, reinforcement)) in [&chat, &agent]
                .into_iter()
                .flat_map(|r| budgets.map(|b| (r, b)))
            {
                let counter = TokenCounter::new(Encoding::O200kBase);
                let (fast, slow) = (Memo::default(), Memo::default());
                for request in requests {
                    let env = |memo| Env {
                        budget,
                        reinforcement,
                        ..env(config, &counter, memo, None)
                    };
                    let shortcut = run(request, &env(&fast));
                    FLOOR_OFF.set(true);
                    let full = run(request, &env(&slow));
                    FLOOR_OFF.set(false);
                    assert_eq!(shortcut.request, full.request, "budget {budget}");
                    let prefix = |r: &Rewrite| r.report.prefix.clone().unwrap();
                    let (shortcut, full) = (prefix(&shortcut), prefix(&full));
                    assert_eq!(shortcut.rebuilt, full.rebuilt);
                    assert!(full.whole_tokens.is_some());
                    left_out += usize::from(shortcut.whole_tokens.is_none());
                }
            }
            // The floor decided without the whole rewrite somewhere.
            assert!(left_out > 0 || index > 1);
        }
    }

    #[test]
    fn a_plan_made_ahead_rewrites_as_planning_again() {
        // A point's tools plan, made to decide it (`known_at`), is handed to its whole rewrite:
        // the rewrite must be what planning again gives, request and every stage's report, with
        // a `tool_choice` naming a tool too (the plan reads it) and the sticky categories of
        // points past the first.
        let chat = synthetic::conversation(12).unwrap();
        let agent = synthetic::autonomous_agent(12).unwrap();
        let mut chosen = chat.clone();
        let name = chosen.tool_names().last().map(|n| n.to_string()).unwrap();
        chosen.tool_choice =
            Nullable::Value(serde_json::json!({"type": "function", "function": {"name": name}}));
        let mut handed = 0;
        for config in &floor_configs() {
            for budget in [2_000, 1_000_000] {
                for request in [&chat, &agent, &chosen] {
                    let (counter, memo) = (TokenCounter::new(Encoding::O200kBase), Memo::default());
                    let env = Env {
                        budget,
                        ..env(config, &counter, &memo, None)
                    };
                    let settings = settings(request, &env);
                    let points = points(&request.messages, settings);
                    let cx = Decide::new(request, &points, &env, settings);
                    for k in 0..points.len() {
                        cx.known_at(k);
                        let planned = cx.planned.take();
                        handed += usize::from(planned.as_ref().is_some_and(|(j, _)| *j == k));
                        cx.planned.set(planned);
                        let ahead = cx.whole_of(k);
                        let again = cx.at(k, super::super::whole);
                        assert_eq!(ahead.request, again.request, "point {k}");
                        assert_eq!(ahead.report.stages, again.report.stages, "point {k}");
                    }
                }
            }
        }
        assert!(handed > 0);
    }

    #[test]
    fn the_floor_is_below_every_whole_rewrite() {
        // Every point of two conversations, the configs of the test above, budgets from tight
        // to none and a reminder: the floor never exceeds the whole rewrite's tokens, whichever
        // step it ends at.
        let reminder = floor_reminder();
        let budgets = [
            (1_000, None),
            (2_000, None),
            (4_000, None),
            (1_000_000, None),
            (1_000_000, Some(&reminder)),
        ];
        let chat = synthetic::conversation(30).unwrap();
        let agent = synthetic::autonomous_agent(30).unwrap();
        let (mut placed, mut loop_steps, mut framed, mut points_read) = (0, 0, 0, 0);
        for config in &floor_configs() {
            for (budget, reinforcement) in budgets {
                for request in [&chat, &agent] {
                    let (counter, memo) = (TokenCounter::new(Encoding::O200kBase), Memo::default());
                    let env = Env {
                        budget,
                        reinforcement,
                        ..env(config, &counter, &memo, None)
                    };
                    let settings = settings(request, &env);
                    let points = points(&request.messages, settings);
                    let cx = Decide::new(request, &points, &env, settings);
                    for (k, point) in points.iter().enumerate() {
                        let Some(known) = cx.known_at(k) else {
                            continue;
                        };
                        let (floor, framing) = cx.floor(point.len, &known);
                        let floor = (floor + framing()).saturating_sub(FLOOR_SLACK);
                        let whole = cx.whole_at(k);
                        assert!(
                            floor <= whole.tokens,
                            "point {k}, budget {budget}: floor {floor} over {}",
                            whole.tokens
                        );
                        let messages = &request.messages[..point.len];
                        let working_set = WorkingSet::of(messages, config.window.recent_tool_steps);
                        let last_user = working_set.last_user.unwrap_or(point.len);
                        loop_steps += usize::from((last_user..point.len).any(|i| {
                            messages[i].role == Role::Assistant && !working_set.contains(i)
                        }));
                        framed +=
                            usize::from((last_user..point.len).any(|i| {
                                messages[i].role == Role::Tool && !working_set.contains(i)
                            }));
                        placed += usize::from(known.placed_tokens > 0);
                        points_read += 1;
                    }
                }
            }
        }
        // The fixtures reach the parts of the floor a whole rewrite may not cut.
        assert!(placed > 0 && loop_steps > 0 && framed > 0 && points_read > 100);
    }

    #[test]
    fn the_recall_tool_joins_a_clients_block_only_with_a_rebuild() {
        let config = PipelineConfig::default();
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        let mut previous: Option<ChatRequest> = None;
        let mut offered = 0;
        for request in requests_of(&synthetic::autonomous_agent(30).unwrap()) {
            let rewrite = run(&request, &env(&config, &counter, &memo, None));
            let prefix = rewrite.report.prefix.clone().unwrap();
            assert_ne!(prefix.rebuilt, Some(Rebuilt::ToolsChanged));
            if let (None, Some(before)) = (prefix.rebuilt, &previous) {
                // Appended: the block sent before, byte for byte, whatever a rebuild would send.
                assert_eq!(rewrite.request.tools, before.tools);
                assert!(rewrite.request.messages.starts_with(&before.messages));
            }
            if rewrite.request.tool_names().contains(&recall::TOOL_NAME) {
                offered += 1;
            }
            previous = Some(rewrite.request);
        }
        assert!(offered > 0, "no rewrite cleared a result");
    }

    #[test]
    fn a_first_request_reads_the_stored_sticky_categories() {
        let mut config = PipelineConfig::default();
        config.tools.min_tool_tokens = 0;
        config.tools.min_stub_tokens = 0;
        config.tools.left_out = crate::pipeline::config::LeftOut::Remove;
        config.compact.recall = false;
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        let request: ChatRequest = serde_json::from_value(serde_json::json!({
            "model": "gpt-4o",
            "messages": [{"role": "user", "content": "and tomorrow?"}],
            "tools": [
                {"type": "function", "function": {"name": "weather_forecast", "description": "Weather forecast for a city."}},
                {"type": "function", "function": {"name": "email_send", "description": "Send an email message."}}
            ]
        }))
        .unwrap();
        let sticky = vec!["weather".to_owned()];
        let with = run(
            &request,
            &Env {
                sticky_categories: &sticky,
                ..env(&config, &counter, &memo, None)
            },
        );
        assert_eq!(with.request.tool_names(), ["weather_forecast"]);
        // The same request of another conversation, with nothing stored: not the memo's answer.
        let without = run(&request, &env(&config, &counter, &memo, None));
        assert!(without.request.tool_names().is_empty());
    }

    #[test]
    fn a_memoized_rewrite_sends_the_clients_own_fields() {
        let config = PipelineConfig::default();
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        let mut first = synthetic::conversation(8).unwrap();
        first.stream = crate::openai::Nullable::Value(true);
        let mut second = synthetic::conversation(8).unwrap();
        second.model = "gpt-4.1".into();
        second
            .extra
            .insert("temperature".into(), serde_json::json!(0.7));
        let one = run(&first, &env(&config, &counter, &memo, None));
        let two = run(&second, &env(&config, &counter, &memo, None));
        // The same messages: the same rewrite of them, each request's own other fields.
        assert_eq!(one.request.messages, two.request.messages);
        assert_eq!(two.request.model, "gpt-4.1");
        assert!(two.request.stream.is_absent());
        assert_eq!(two.request.extra["temperature"], serde_json::json!(0.7));
        assert_eq!(one.request.extra["temperature"], serde_json::json!(0));

        // Another conversation whose tool calls carry other ids is not another's rewrite.
        let mut other = synthetic::conversation(8).unwrap();
        for message in &mut other.messages {
            if let crate::openai::Nullable::Value(calls) = &mut message.tool_calls {
                Arc::make_mut(calls)
                    .iter_mut()
                    .for_each(|c| c.id = format!("x{}", c.id));
            }
            if let crate::openai::Nullable::Value(id) = &mut message.tool_call_id {
                *id = format!("x{id}").into();
            }
        }
        let three = run(&other, &env(&config, &counter, &memo, None));
        let ids = |r: &ChatRequest| -> Vec<String> {
            r.messages
                .iter()
                .flat_map(|m| m.tool_calls().iter().map(|c| c.id.clone()))
                .collect()
        };
        assert!(!ids(&three.request).is_empty());
        assert!(ids(&three.request).iter().all(|id| id.starts_with('x')));
    }

    #[test]
    fn a_long_history_nothing_is_known_of_is_rebuilt_not_replayed() {
        let mut messages = vec![serde_json::json!({"role": "system", "content": "Be brief."})];
        for turn in 0..=MAX_REPLAY + 4 {
            messages
                .push(serde_json::json!({"role": "user", "content": format!("Question {turn}?")}));
            messages.push(
                serde_json::json!({"role": "assistant", "content": format!("Answer {turn}.")}),
            );
        }
        messages.push(serde_json::json!({"role": "user", "content": "And the last one?"}));
        let request: ChatRequest =
            serde_json::from_value(serde_json::json!({"model": "gpt-4o", "messages": messages}))
                .unwrap();
        let config = PipelineConfig::default();
        let counter = TokenCounter::new(Encoding::O200kBase);
        let cold = run(&request, &env(&config, &counter, &Memo::default(), None));
        let prefix = cold.report.prefix.unwrap();
        assert_eq!(prefix.rebuilt, Some(Rebuilt::LongHistory));
        // With the state the store remembers of the request before, it is replayed from there.
        let mut before = request.clone();
        before.messages.truncate(request.messages.len() - 2);
        let memo = Memo::default();
        let stored = run(&before, &env(&config, &counter, &memo, None)).remember;
        let resumed = run(&request, &env(&config, &counter, &Memo::default(), stored));
        assert_ne!(
            resumed.report.prefix.and_then(|p| p.rebuilt),
            Some(Rebuilt::LongHistory)
        );
    }

    #[test]
    fn appended_reports_still_sum_to_the_saving() {
        let config = PipelineConfig::default();
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        for request in requests(20) {
            let rewrite = run(&request, &env(&config, &counter, &memo, None));
            let report = &rewrite.report;
            assert_eq!(report.tokens_before, counter.request(&request));
            assert_eq!(report.tokens_after, counter.request(&rewrite.request));
            let saved: usize = report.savings_by_stage().iter().map(|(_, n)| n).sum();
            assert_eq!(saved, report.tokens_before - report.tokens_after);
        }
    }

    #[test]
    fn without_a_threshold_every_request_is_rewritten_whole() {
        let config = PipelineConfig {
            clear_at_least_tokens: 0,
            ..PipelineConfig::default()
        };
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        let request = synthetic::conversation(30).unwrap();
        let rewrite = run(&request, &env(&config, &counter, &memo, None));
        assert_eq!(rewrite.report.prefix, None);
        assert_eq!(rewrite.remember, None);
        assert!(
            rewrite
                .report
                .stages
                .iter()
                .all(|s| s.stage != StageName::Append)
        );
    }
}
