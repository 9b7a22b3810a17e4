package config

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestAdminKeys(t *testing.T) {
	c, err := load(t, nil)
	if err != nil || len(c.AdminKeys) != 0 || c.UISecureCookies {
		t.Fatalf("defaults: %v %v %v", c.AdminKeys, c.UISecureCookies, err)
	}
	c, err = load(t, map[string]string{"ONCEFLOW_ADMIN_KEYS": " admin-key-0123456789 ,second-admin-key-0123,admin-key-0123456789", "ONCEFLOW_UI_SECURE_COOKIES": "true"})
	if err != nil || !slices.Equal(c.AdminKeys, []string{"admin-key-0123456789", "second-admin-key-0123"}) || !c.UISecureCookies {
		t.Fatalf("%v %v %v", c.AdminKeys, c.UISecureCookies, err)
	}
	for _, bad := range []string{"short", "admin-key-0123456789,", "admin key 0123456789x"} {
		_, err := load(t, map[string]string{"ONCEFLOW_ADMIN_KEYS": bad})
		var ce *Error
		if !errors.As(err, &ce) || ce.Name != "ONCEFLOW_ADMIN_KEYS" || strings.Contains(err.Error(), "0123456789") {
			t.Errorf("%q: %v (must name the variable, never echo a key)", bad, err)
		}
	}
	// A tenant's API key is never an admin key.
	_, err = load(t, map[string]string{"ONCEFLOW_API_KEYS": "acme:shared-key-0123456789", "ONCEFLOW_ADMIN_KEYS": "shared-key-0123456789"})
	var ce *Error
	if !errors.As(err, &ce) || ce.Name != "ONCEFLOW_ADMIN_KEYS" || strings.Contains(err.Error(), "shared-key") {
		t.Fatalf("an admin key that is a tenant's: %v", err)
	}
}
