package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// MaxTopicLen is the longest topic ValidTopic accepts, in bytes.
const MaxTopicLen = 200

// ValidTopic reports whether topic can name an effect: 1 to MaxTopicLen bytes of
// printable ASCII without spaces and without "*" (which a Router reads as a wildcard),
// for example "payments.refund". Writers of outbox rows should check it; the outbox
// table itself only requires a non-empty topic.
func ValidTopic(topic string) bool {
	if len(topic) == 0 || len(topic) > MaxTopicLen {
		return false
	}
	for i := 0; i < len(topic); i++ {
		if c := topic[i]; c < 0x21 || c > 0x7e || c == '*' {
			return false
		}
	}
	return true
}

// TopicSet selects outbox rows by topic: a topic is in the set when it equals one of
// Topics or starts with one of Prefixes. The empty prefix selects every topic; the zero
// value selects none.
type TopicSet struct {
	// Topics are matched exactly.
	Topics []string
	// Prefixes match every topic that starts with one of them.
	Prefixes []string
}

// Match reports whether topic is in s.
func (s TopicSet) Match(topic string) bool {
	if slices.Contains(s.Topics, topic) {
		return true
	}
	return slices.ContainsFunc(s.Prefixes, func(p string) bool { return strings.HasPrefix(topic, p) })
}

// All reports whether s selects every topic (it holds the empty prefix).
func (s TopicSet) All() bool { return slices.Contains(s.Prefixes, "") }

// TopicSender is implemented by a Sender that sends only some topics, such as a
// *Router. A Relay whose Sender is one claims only the rows of those topics and leaves
// the others, untouched and never exhausted, to the relays that send them (another
// process may have the senders this one lacks); its Store must then implement
// TopicStore, unless the set selects every topic.
type TopicSender interface {
	Sender
	// Topics returns the topics Send delivers. It must not change after the Relay is
	// created.
	Topics() TopicSet
}

// TopicStore is a Store that can claim the rows of some topics only. pgoutbox.Store
// implements it.
type TopicStore interface {
	Store
	// ClaimTopics is Claim restricted to the rows whose topic is in topics.
	ClaimTopics(ctx context.Context, relay string, topics TopicSet, limit int, lease time.Duration) ([]Message, error)
}

// ErrNoSender is wrapped by the error a Router returns for a message whose topic has no
// sender. A Relay never claims such a row (it claims only the Router's topics), so the
// error means a Store that ignored the topic filter; it is not permanent, so the row is
// retried with backoff rather than exhausted at once.
var ErrNoSender = errors.New("no sender for the topic")

// Router is a Sender that hands each message to the Sender of its topic. Create it with
// NewRouter; it is safe for concurrent use when its senders are. As a TopicSender it
// makes the Relay claim only the topics it has senders for.
type Router struct {
	exact    map[string]Sender
	prefixes []prefixRoute // longest prefix first
}

type prefixRoute struct {
	prefix string
	sender Sender
}

var _ TopicSender = (*Router)(nil)

// NewRouter returns a Router over senders, whose keys are topics or prefixes: a key
// ending in "." is a prefix ("email." matches "email.reply" and "email.receipt.sent"), a
// key ending in "*" is the prefix before it ("email.*" is "email.", "pay*" matches
// "payments.refund", "*" matches every topic), any other key is one topic. A topic's
// sender is the one of its exact key, else of its longest matching prefix. It returns
// an error naming the key for a nil sender, an empty key, a "*" before the end, or two
// keys that are the same prefix ("email." and "email.*").
func NewRouter(senders map[string]Sender) (*Router, error) {
	r := &Router{exact: map[string]Sender{}}
	byPrefix := map[string]string{} // prefix -> the key that declared it
	for _, key := range slices.Sorted(maps.Keys(senders)) {
		s := senders[key]
		switch {
		case s == nil:
			return nil, fmt.Errorf("outbox router: topic %q: nil sender", key)
		case key == "":
			return nil, errors.New("outbox router: empty topic")
		case strings.Contains(strings.TrimSuffix(key, "*"), "*"):
			return nil, fmt.Errorf("outbox router: topic %q: \"*\" may only end a prefix", key)
		}
		prefix, isPrefix := strings.CutSuffix(key, "*")
		if !isPrefix && strings.HasSuffix(key, ".") {
			isPrefix = true
		}
		if !isPrefix {
			r.exact[key] = s
			continue
		}
		if other, dup := byPrefix[prefix]; dup {
			return nil, fmt.Errorf("outbox router: topics %q and %q are the same prefix", other, key)
		}
		byPrefix[prefix] = key
		r.prefixes = append(r.prefixes, prefixRoute{prefix: prefix, sender: s})
	}
	slices.SortFunc(r.prefixes, func(a, b prefixRoute) int {
		return cmp.Or(cmp.Compare(len(b.prefix), len(a.prefix)), strings.Compare(a.prefix, b.prefix))
	})
	return r, nil
}

// Lookup returns the sender of topic: its exact key's, else its longest matching
// prefix's; ok is false when none matches.
func (r *Router) Lookup(topic string) (s Sender, ok bool) {
	if s, ok := r.exact[topic]; ok {
		return s, true
	}
	for _, p := range r.prefixes {
		if strings.HasPrefix(topic, p.prefix) {
			return p.sender, true
		}
	}
	return nil, false
}

// Send hands m to the sender of m.Topic and returns its result, or an error wrapping
// ErrNoSender when no key matches the topic.
func (r *Router) Send(ctx context.Context, m Message) error {
	s, ok := r.Lookup(m.Topic)
	if !ok {
		return fmt.Errorf("outbox router: topic %q: %w", m.Topic, ErrNoSender)
	}
	return s.Send(ctx, m)
}

// Topics implements TopicSender: the router's exact topics and prefixes.
func (r *Router) Topics() TopicSet {
	s := TopicSet{Topics: slices.Sorted(maps.Keys(r.exact))}
	for _, p := range r.prefixes {
		s.Prefixes = append(s.Prefixes, p.prefix)
	}
	return s
}
