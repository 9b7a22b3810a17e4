package onceflow

import (
	"fmt"
	"maps"
	"strings"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
)

// setupOutbox prepares the outbox relay Run runs when Config.DB is set: it sends
// Config.Senders by topic and the built-in TopicEnqueue sender of EnqueueTx, and
// claims only those topics, so the rows of a topic this process has no sender for wait,
// untouched, for a process that has one.
func (c *Client) setupOutbox() error {
	if len(c.cfg.Senders) > 0 && c.cfg.DB == nil {
		return fmt.Errorf("onceflow: Config.Senders needs Config.DB (the outbox they send)")
	}
	for key := range c.cfg.Senders {
		if strings.HasPrefix(key, ReservedTopicPrefix) {
			return fmt.Errorf("onceflow: Config.Senders: topic %q: the prefix %q is onceflow's", key, ReservedTopicPrefix)
		}
	}
	if c.cfg.DB == nil {
		return nil
	}
	senders := maps.Clone(c.cfg.Senders)
	if senders == nil {
		senders = map[string]outbox.Sender{}
	}
	senders[TopicEnqueue] = outbox.SenderFunc(c.sendEnqueue)
	router, err := outbox.NewRouter(senders)
	if err != nil {
		return fmt.Errorf("onceflow: Config.Senders: %w", err)
	}
	rc := c.cfg.Relay
	if rc.Logger == nil {
		rc.Logger = c.log
	}
	if rc.Registerer == nil {
		rc.Registerer = c.cfg.Registerer
	}
	relay, err := outbox.NewRelay(pgoutbox.New(c.cfg.DB), router, rc)
	if err != nil {
		return fmt.Errorf("onceflow: Config.Relay: %w", err)
	}
	c.router, c.relay = router, relay
	c.background = append(c.background, relay.Run)
	return nil
}
