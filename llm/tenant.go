package llm

import "context"

type tenantKey struct{}

// WithTenant returns ctx carrying tenant, the tenant whose model calls are made with it:
// the limiter admits them for that tenant (its budget, share and cap) and the ledger
// records it on their rows. A job's model calls carry the job's tenant.
func WithTenant(ctx context.Context, tenant string) context.Context {
	return context.WithValue(ctx, tenantKey{}, tenant)
}

// TenantFrom returns the tenant WithTenant put in ctx, "" for none.
func TenantFrom(ctx context.Context) string {
	t, _ := ctx.Value(tenantKey{}).(string)
	return t
}
